"""Checks that any rl-wrapped model must pass, shared by the per-architecture tests (tests/rl/)."""
from __future__ import annotations

import torch

import rl


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
