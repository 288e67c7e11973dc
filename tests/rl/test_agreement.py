"""Trainer == sampler, bitwise: rl.logprobs over prompt+completion equals the log-probs rl.generate
reported while decoding with its KV cache, whatever the batch (alone, 8, 32), padding side or path."""
from __future__ import annotations

import pytest
import torch

import rl
from rl.testing import ARCHITECTURES, tiny_model

ARCHS = ARCHITECTURES
MAX_NEW_TOKENS = 4


def _prompts(count: int, seed: int = 0, longest: int = 10) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest + 1, (count,), generator=generator).tolist()
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module", params=ARCHS)
def sampled(request):
    """A model and 32 mixed-length prompts sampled in one batch of 32 (per-prompt seeds)."""
    model = rl.wrap(tiny_model(request.param, seed=11))
    prompts = _prompts(32, seed=len(request.param))
    generation = rl.generate(model, prompts, MAX_NEW_TOKENS, temperature=1.0, seed=list(range(100, 132)),
                             batch_size=32)
    return model, prompts, generation


@pytest.mark.parametrize("left", [False, True], ids=["right_padded", "left_padded"])
def test_trainer_logprobs_equal_sampler_logprobs(sampled, left):
    model, prompts, generation = sampled
    assert [len(t) for t in generation.tokens] == [MAX_NEW_TOKENS] * len(prompts)
    input_ids, attention_mask, completion_mask = generation.padded(left=left)
    assert int(attention_mask.sum()) < attention_mask.numel()  # mixed lengths: there is padding
    trainer = rl.logprobs(model, input_ids, attention_mask)
    sampler = torch.cat(generation.logprobs)
    assert trainer.dtype == sampler.dtype == torch.float32
    assert trainer.requires_grad  # the trainer's side is differentiable
    assert torch.equal(trainer[completion_mask].detach(), sampler)
    assert bool((sampler < 0).all())


def test_batch_composition_does_not_change_tokens_or_logprobs(sampled):
    model, prompts, in_32 = sampled
    seeds = list(range(100, 132))
    in_8 = rl.generate(model, prompts[:16], MAX_NEW_TOKENS, seed=seeds[:16], batch_size=8)
    assert in_8.tokens == in_32.tokens[:16]
    for a, b in zip(in_8.logprobs, in_32.logprobs):
        assert torch.equal(a, b)
    for i in (0, 5, 17, 31):  # alone, subsampled to stay fast
        alone = rl.generate(model, [prompts[i]], MAX_NEW_TOKENS, seed=[seeds[i]])
        assert alone.tokens[0] == in_32.tokens[i]
        assert torch.equal(alone.logprobs[0], in_32.logprobs[i])


def test_sampling_is_seeded_and_logprobs_ignore_temperature():
    model = tiny_model("qwen3_moe", seed=4)
    prompts = _prompts(3, seed=9)
    a = rl.generate(model, prompts, 5, temperature=0.7, top_k=20, seed=3)
    b = rl.generate(model, prompts, 5, temperature=0.7, top_k=20, seed=3)
    c = rl.generate(model, prompts, 5, temperature=0.7, top_k=20, seed=4)
    assert a.tokens == b.tokens and all(torch.equal(x, y) for x, y in zip(a.logprobs, b.logprobs))
    assert a.tokens != c.tokens
    # Log-probs are those of the raw logits: recomputing them under any temperature gives the same.
    input_ids, attention_mask, completion_mask = c.padded()
    with torch.no_grad():
        assert torch.equal(rl.logprobs(model, input_ids, attention_mask)[completion_mask], torch.cat(c.logprobs))
        # Greedy picks the arg-max of the logits the trainer computes.
        greedy = rl.generate(model, prompts, 3, temperature=0.0)
        input_ids, attention_mask, _ = greedy.padded()
        logits = rl.wrap(model)(input_ids, attention_mask=attention_mask).logits
    for row, (prompt, tokens) in enumerate(zip(greedy.prompts, greedy.tokens)):
        positions = torch.arange(len(prompt) - 1, len(prompt) + len(tokens) - 1)
        assert logits[row, positions].float().argmax(-1).tolist() == tokens


def test_eos_stops_a_sequence_early():
    model = tiny_model("mixtral", seed=4)
    prompts = _prompts(4, seed=2)
    free = rl.generate(model, prompts, 6, seed=1)
    eos = free.tokens[0][2]
    stopped = rl.generate(model, prompts, 6, seed=1, eos_token_id=eos)
    assert stopped.tokens[0] == free.tokens[0][:free.tokens[0].index(eos) + 1]
    for full, cut, lp_full, lp_cut in zip(free.tokens, stopped.tokens, free.logprobs, stopped.logprobs):
        assert cut == full[:len(cut)] and torch.equal(lp_cut, lp_full[:len(cut)])


def test_qwen2_moe_shared_expert_gate_on_the_cpu_is_the_reference_sigmoid():
    """The CPU trainer's shared-expert gate: the correctly rounded sigmoid (mok.reference.elementwise), in the
    logits' dtype, whatever the batch (CPU torch's vectorised and scalar loops may round differently)."""
    import torch

    from mok.reference import elementwise
    from rl.models.decoder import shared_expert_gate

    logits_T1 = (torch.randn(1000, 1, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    gate_T1 = shared_expert_gate(logits_T1)
    assert gate_T1.dtype == torch.bfloat16
    assert torch.equal(gate_T1, elementwise.sigmoid(logits_T1).bfloat16())
    assert torch.equal(shared_expert_gate(logits_T1[3:4]), gate_T1[3:4])
