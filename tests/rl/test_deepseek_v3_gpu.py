"""DeepSeek-V3 family through rl on the GPU at real shapes: a Moonlight-16B-A3B-shaped model (hidden 2048, MLA
with a plain q_proj, kv_lora_rank 512, 16 heads of 128 + 64 rope dims, values of 128; 64 experts top-6 with 2
shared; the first layer dense), 4 layers, DeepSeek-V3's YaRN rope, random weights. The trainer's bits equal the
decoder's (its latent KV cache), a sequence alone equals it inside a batch, and the backward is deterministic.
Run on the H200: `python3 -m pytest -q -s tests/rl/test_deepseek_v3_gpu.py`."""
from __future__ import annotations

import pytest
import torch

import rl
from rl.testing import tiny_model

pytestmark = pytest.mark.gpu

VOCAB = 163840
MOONLIGHT_LAYERS = dict(
    hidden_size=2048, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None,
    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
    num_experts_per_tok=6, n_shared_experts=2, moe_intermediate_size=1408, intermediate_size=11264,
    first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.446, norm_topk_prob=True,
    vocab_size=VOCAB, max_position_embeddings=8192, initializer_range=0.02,
    rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 2048},
)
MAX_NEW_TOKENS = 10


@pytest.fixture(scope="module")
def model():
    return rl.wrap(tiny_model("deepseek_v3", seed=0, device="cuda", **MOONLIGHT_LAYERS))


def _prompts(count: int, longest: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, longest + 1, (count,), generator=generator).tolist()
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def test_trainer_equals_decoder_and_a_sequence_alone_its_batch(model):
    prompts = _prompts(6, longest=80)
    seeds = list(range(6))
    batched = rl.generate(model, prompts, MAX_NEW_TOKENS, temperature=1.0, seed=seeds, batch_size=6)
    sampler = torch.cat(batched.logprobs)
    input_ids, attention_mask, completion_mask = batched.padded(left=True)
    with torch.no_grad():
        trainer = rl.logprobs(model, input_ids, attention_mask)
    equal = torch.equal(trainer[completion_mask.to(trainer.device)].cpu(), sampler)
    alone = rl.generate(model, [prompts[2]], MAX_NEW_TOKENS, temperature=1.0, seed=[seeds[2]])
    alone_equal = alone.tokens[0] == batched.tokens[2] and torch.equal(alone.logprobs[0], batched.logprobs[2])
    print(f"\n[rl gpu] {torch.cuda.get_device_name()} moonlight-shaped 4 layers: {sampler.numel()} sampled tokens; "
          f"trainer == decoder bitwise: {equal}; alone == batch: {alone_equal}")
    assert equal and alone_equal
    assert bool(torch.isfinite(sampler).all())


def test_backward_is_deterministic(model):
    from verify import fingerprint

    generation = rl.generate(model, _prompts(3, longest=60), 4, seed=0)
    input_ids, attention_mask, completion_mask = generation.padded()
    completion_mask = completion_mask.to("cuda").float()
    digests = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        logprobs = rl.logprobs(model, input_ids, attention_mask)
        (-(logprobs * completion_mask).sum() / completion_mask.sum()).backward()
        digests.append({name: fingerprint(p.grad) for name, p in model.named_parameters() if p.grad is not None})
    print(f"\n[rl gpu] moonlight-shaped backward twice: {len(digests[0])} gradients, identical: "
          f"{digests[0] == digests[1]}")
    assert digests[0] == digests[1]
    model.zero_grad(set_to_none=True)
