"""Trainer == decoder on the GPU at a size that matters, random weights, 4 layers of: a Qwen3-MoE-shaped model
(Qwen3-30B-A3B's layer: hidden 2048, 32/4 heads of 128, 128 experts, top-8, expert intermediate 768, vocab 151936)
and a DeepSeek-V3-family one (Moonlight-16B-A3B's: hidden 2048, MLA with a plain q_proj, kv_lora_rank 512, 16
heads of 128 + 64 rope dims, values of 128; 64 experts top-6 with 2 shared, the first layer dense; DeepSeek-V3's
YaRN rope). Run on the H200: `python3 -m pytest -q -s tests/rl/test_gpu.py`."""
from __future__ import annotations

import pytest
import torch

import rl
from rl.testing import tiny_model

pytestmark = pytest.mark.gpu

SHAPES = {
    "qwen3_moe": dict(
        hidden_size=2048, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
        vocab_size=151936, max_position_embeddings=4096, initializer_range=0.02, norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "deepseek_v3": dict(
        hidden_size=2048, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
        num_experts_per_tok=6, n_shared_experts=2, moe_intermediate_size=1408, intermediate_size=11264,
        first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.446, norm_topk_prob=True,
        vocab_size=163840, max_position_embeddings=8192, initializer_range=0.02,
        rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 2048},
    ),
}
MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module", params=list(SHAPES))
def model(request):
    return rl.wrap(tiny_model(request.param, seed=0, device="cuda", **SHAPES[request.param]))


def _prompts(model, count: int, longest: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, longest + 1, (count,), generator=generator).tolist()
    return [torch.randint(3, model.config.vocab_size, (n,), generator=generator).tolist() for n in lengths]


def test_trainer_equals_decoder_at_size(model):
    prompts = _prompts(model, 8, longest=64)
    seeds = list(range(8))
    batched = rl.generate(model, prompts, MAX_NEW_TOKENS, temperature=1.0, seed=seeds, batch_size=8)
    sampler = torch.cat(batched.logprobs)
    equal = {}
    for left in (False, True):
        input_ids, attention_mask, completion_mask = batched.padded(left=left)
        with torch.no_grad():
            trainer = rl.logprobs(model, input_ids, attention_mask)
        equal[left] = torch.equal(trainer[completion_mask.to(trainer.device)].cpu(), sampler)
    alone_equal = []
    for i in (0, 3):
        alone = rl.generate(model, [prompts[i]], MAX_NEW_TOKENS, seed=[seeds[i]])
        alone_equal.append(alone.tokens[0] == batched.tokens[i] and torch.equal(alone.logprobs[0], batched.logprobs[i]))
    print(f"\n[rl gpu] {torch.cuda.get_device_name()} {model.config.model_type}-shaped 4 layers: {len(prompts)} "
          f"prompts "
          f"(lengths {min(map(len, prompts))}-{max(map(len, prompts))}), {sampler.numel()} sampled tokens, "
          f"logprobs in [{sampler.min():.3f}, {sampler.max():.3f}]; trainer == decoder bitwise: right-padded "
          f"{equal[False]}, left-padded {equal[True]}; alone == batch of 8: {alone_equal}")
    assert equal[False] and equal[True]
    assert all(alone_equal)
    assert bool((sampler < 0).all()) and bool(torch.isfinite(sampler).all())


def test_backward_is_deterministic_at_size(model):
    from verify import fingerprint

    prompts = _prompts(model, 4, longest=48)
    generation = rl.generate(model, prompts, 4, seed=0)
    input_ids, attention_mask, completion_mask = generation.padded()
    completion_mask = completion_mask.to("cuda").float()
    digests = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        logprobs = rl.logprobs(model, input_ids, attention_mask)
        (-(logprobs * completion_mask).sum() / completion_mask.sum()).backward()
        digests.append({name: fingerprint(p.grad) for name, p in model.named_parameters()})
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    print(f"\n[rl gpu] backward twice: {len(digests[0])} parameter gradients, identical: {digests[0] == digests[1]}")
    assert not missing
    assert digests[0] == digests[1]
    model.zero_grad(set_to_none=True)


def test_qwen2_moe_shared_expert_gate_has_the_bits_of_transformers_and_vllm():
    """Qwen2-MoE scales its shared expert by F.sigmoid of bf16 gate logits (transformers and vLLM alike): the
    trainer's gate has its bits (rl/models/decoder.py), and a row's bits do not depend on the batch."""
    from rl.models.decoder import shared_expert_gate

    logits_T1 = (torch.randn(65536, 1, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * 3).bfloat16()
    gate_T1 = shared_expert_gate(logits_T1)
    assert gate_T1.dtype == torch.bfloat16
    assert torch.equal(gate_T1, torch.nn.functional.sigmoid(logits_T1))
    # element by element: a row alone gives the bits it has inside the batch
    assert torch.equal(shared_expert_gate(logits_T1[7:8]), gate_T1[7:8])
