"""Checks that any rl-wrapped model must pass, shared by the per-architecture tests (tests/rl/)."""
from __future__ import annotations

import torch

import rl


def assert_generate_equals_logprobs(model, prompt_lengths: tuple[int, ...]) -> None:
    """rl.generate's sampled log-probabilities (5 tokens per prompt, seeded, one batch) == rl.logprobs over the
    left-padded generations, and prompt 2 generated alone == inside the batch (tokens and log-probabilities)."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in prompt_lengths]
    seeds = list(range(1, len(prompts) + 1))
    generation = rl.generate(model, prompts, 5, temperature=1.0, seed=seeds, batch_size=len(prompts))
    input_ids, attention_mask, completion_mask = generation.padded(left=True)
    trainer = rl.logprobs(model, input_ids, attention_mask)
    assert torch.equal(trainer[completion_mask].detach(), torch.cat(generation.logprobs))
    alone = rl.generate(model, [prompts[2]], 5, temperature=1.0, seed=[seeds[2]])
    assert alone.tokens[0] == generation.tokens[2] and torch.equal(alone.logprobs[0], generation.logprobs[2])


def assert_alone_equals_inside_padded_batch(model, width: int, length: int = 9) -> None:
    """rl.logprobs of a `length`-token sequence alone == the same sequence left-padded in row 1 of a [3, width]
    batch among full rows (bitwise)."""
    generator = torch.Generator().manual_seed(7)
    sequence = torch.randint(3, 512, (length,), generator=generator)
    batch = torch.randint(3, 512, (3, width), generator=generator)
    mask = torch.ones_like(batch)
    start = width - length
    batch[1], mask[1] = 0, 0
    batch[1, start:], mask[1, start:] = sequence, 1
    with torch.no_grad():
        alone = rl.logprobs(model, sequence[None])[0]
        inside = rl.logprobs(model, batch, mask)[1, start:]
    assert torch.equal(alone, inside)


def deterministic_gradients(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of rl.logprobs(...).sum() on a fixed [2, 10] batch, computed twice: asserts the
    two runs equal bitwise and every gradient finite and nonzero; returns them by parameter name."""
    model.train()
    input_ids = torch.randint(3, 512, (2, 10), generator=torch.Generator().manual_seed(5))

    def gradients():
        model.zero_grad(set_to_none=True)
        rl.logprobs(model, input_ids).sum().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    first, second = gradients(), gradients()
    for name, grad in first.items():
        assert torch.equal(grad, second[name]), name
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0, name
    return first
