"""GLM-4.5 (transformers' Glm4MoeForCausalLM) through rl.wrap: transformers' numbers in fp32 for every implemented
variant (partial rotary, q/k norm, biases, grouped sigmoid routing with its correction bias and scaling, shared
experts, dense first layers), the trainer's bits equal the reference sampler's, batch-invariant, a deterministic
backward, and the config values mok does not implement refused by name. The tests that run every architecture
(tests/rl/test_wrap.py, test_agreement.py, test_contract.py, test_config_fields.py) include glm4_moe too."""
from __future__ import annotations

import pytest
import torch

import rl
from rl.models import adapter_for
from rl.testing import tiny_model
from tests.helpers.model_checks import (
    assert_alone_equals_inside_padded_batch,
    assert_generate_equals_logprobs,
    deterministic_gradients,
)

ARCH = "glm4_moe"


@pytest.mark.parametrize("overrides", [
    {},
    {"use_qk_norm": False, "attention_bias": False},
    {"partial_rotary_factor": 1.0},
    {"partial_rotary_factor": 0.25},
    {"n_group": 1, "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0},
    {"n_group": 4, "topk_group": 2, "num_experts_per_tok": 3},
    {"n_shared_experts": 2, "first_k_dense_replace": 2},
    {"first_k_dense_replace": 0, "tie_word_embeddings": True},
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_wrapped_forward_matches_transformers_in_fp32(overrides):
    model = tiny_model(ARCH, seed=4, dtype=torch.float32, **overrides)
    input_ids = torch.randint(3, 512, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(input_ids).logits
        got = rl.wrap(model)(input_ids).logits
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


def test_the_adapter_reads_the_partial_rotary_and_the_routing():
    model = tiny_model(ARCH)
    adapter = adapter_for(rl.wrap(model))
    assert adapter.rotary_dim == 16  # head_dim 32 * partial_rotary_factor 0.5
    dense, *sparse = adapter.layers
    assert not hasattr(dense.mlp, "router")
    for layer in sparse:
        assert layer.mlp.grouped.n_group == 2 and layer.mlp.grouped.topk_group == 1
        assert layer.mlp.grouped.scaling == 2.5 and layer.mlp.shared_expert_gate is None
        assert layer.attention.qk_norm == "per_head" and layer.attention.q_proj.bias is not None


def test_the_correction_bias_is_read_at_every_forward():
    """A bias that changes the choice of experts changes the logits, as in transformers (not a copy at wrap)."""
    model = rl.wrap(tiny_model(ARCH, seed=1, dtype=torch.float32))
    input_ids = torch.randint(3, 512, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(input_ids).logits
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias[:4] += 1.0  # every token chooses from group 0
        after = model(input_ids).logits
    assert not torch.equal(before, after)
    reference = tiny_model(ARCH, seed=1, dtype=torch.float32)
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(after, reference(input_ids).logits, atol=2e-5, rtol=2e-5)


def test_trainer_logprobs_equal_sampler_logprobs_bitwise():
    assert_generate_equals_logprobs(rl.wrap(tiny_model(ARCH, seed=11)), prompt_lengths=(1, 4, 9, 6))


def test_a_sequence_alone_equals_it_inside_a_padded_batch():
    assert_alone_equals_inside_padded_batch(rl.wrap(tiny_model(ARCH, seed=1)), width=13)


def test_backward_is_deterministic_and_reaches_the_router():
    first = deterministic_gradients(rl.wrap(tiny_model(ARCH, seed=2)))
    assert "model.layers.1.mlp.gate.weight" in first  # the router learns through the grouped weights


@pytest.mark.parametrize("overrides, field", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                          "original_max_position_embeddings": 128, "partial_rotary_factor": 0.5}},
     "rope_parameters"),
    ({"partial_rotary_factor": 0.3}, "partial_rotary_factor"),  # rotary_dim 9: odd
    ({"n_group": 3}, "n_group"),  # 8 experts in 3 groups
    ({"n_group": 2, "topk_group": 3}, "topk_group"),
    ({"n_group": 8, "topk_group": 4}, "n_group"),  # groups of one expert cannot be scored by their best two
    ({"num_experts_per_tok": 5, "n_group": 2, "topk_group": 1}, "num_experts_per_tok"),
    ({"output_router_logits": True}, "output_router_logits"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
])
def test_unimplemented_values_are_refused_by_name(overrides, field):
    with pytest.raises(rl.UnsupportedModelError, match=rf"glm4_moe: .*config\.{field}"):
        rl.wrap(tiny_model(ARCH, **overrides))
