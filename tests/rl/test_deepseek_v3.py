"""DeepSeek-V3 family (transformers' DeepseekV3ForCausalLM) through rl.wrap: transformers' numbers in fp32 for every
implemented variant (q LoRA or a plain q_proj as Moonlight, YaRN with its mscale in the softmax scale and in cos/sin,
interleaved or half rope, attention biases, grouped sigmoid routing, shared experts, dense first layers), the
trainer's bits equal the reference sampler's (its latent KV cache), batch-invariant, a deterministic backward, and
the config values mok does not implement refused by name. The tests that run every architecture
(tests/rl/test_wrap.py, test_agreement.py, test_contract.py, test_config_fields.py) include deepseek_v3 too."""
from __future__ import annotations

import pytest
import torch

import rl
from rl.models import adapter_for
from rl.models.mla import MLAttention
from rl.testing import tiny_model
from tests.helpers.model_checks import (
    assert_alone_equals_inside_padded_batch,
    assert_generate_equals_logprobs,
    deterministic_gradients,
)

ARCH = "deepseek_v3"
_DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


@pytest.mark.parametrize("overrides", [
    {},
    {"q_lora_rank": None},  # Moonlight-16B-A3B / DeepSeek-V2-Lite: a plain q_proj
    {"rope_parameters": _DEFAULT_ROPE, "rope_interleave": False},
    {"attention_bias": True, "n_group": 1, "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0},
    {"n_group": 4, "topk_group": 2, "num_experts_per_tok": 3, "n_shared_experts": 2, "first_k_dense_replace": 0},
    {"rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 40.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 16}},  # DeepSeek-V3's own
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_wrapped_forward_matches_transformers_in_fp32(overrides):
    model = tiny_model(ARCH, seed=4, dtype=torch.float32, **overrides)
    input_ids = torch.randint(3, 512, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(input_ids).logits
        got = rl.wrap(model)(input_ids).logits
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


def test_the_adapter_reads_mla_and_yarn():
    adapter = adapter_for(rl.wrap(tiny_model(ARCH)))
    dense, *sparse = adapter.layers
    assert not hasattr(dense.mlp, "router") and all(layer.mlp.grouped.scaling == 2.5 for layer in sparse)
    attention = dense.attention
    assert isinstance(attention, MLAttention) and attention.q_proj is None and attention.q_a_norm is not None
    assert (attention.latent_dim, attention.rope_dim, attention.nope_dim, attention.value_dim) == (20, 8, 12, 10)
    assert (attention.num_kv_heads, attention.head_dim, attention.value_head_dim) == (1, 28, 20)
    assert attention.yarn.factor == 4.0 and attention.yarn.attention_factor != 1.0  # mscale 1 / mscale_all_dim 0.8
    assert attention.scale != 20 ** -0.5 and not attention.neox_style


def test_trainer_logprobs_equal_sampler_logprobs_bitwise():
    """rl.generate decodes from a cache of latent keys [kv_c, k_pe] and values kv_c: the same bits as training."""
    assert_generate_equals_logprobs(rl.wrap(tiny_model(ARCH, seed=11)), prompt_lengths=(1, 4, 70, 6))


def test_a_sequence_alone_equals_it_inside_a_padded_batch():
    # rows past one key block of the latent attention
    assert_alone_equals_inside_padded_batch(rl.wrap(tiny_model(ARCH, seed=1)), width=80)


def test_backward_is_deterministic_and_reaches_every_weight():
    first = deterministic_gradients(rl.wrap(tiny_model(ARCH, seed=2)))
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "q_a_layernorm", "kv_a_layernorm"):
        assert f"model.layers.0.self_attn.{name}.weight" in first


@pytest.mark.parametrize("overrides, field", [
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, "rope_parameters"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "truncate": False,
                          "original_max_position_embeddings": 128}}, "rope_parameters"),
    ({"num_key_value_heads": 1}, "num_key_value_heads"),
    ({"n_group": 3}, "n_group"),
    ({"num_experts_per_tok": 5, "n_group": 2, "topk_group": 1}, "num_experts_per_tok"),
    ({"output_router_logits": True}, "output_router_logits"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
])
def test_unimplemented_values_are_refused_by_name(overrides, field):
    with pytest.raises(rl.UnsupportedModelError, match=rf"deepseek_v3: .*config\.{field}"):
        rl.wrap(tiny_model(ARCH, **overrides))


def test_the_contract_reads_vllms_renamed_yarn_as_the_trainers():
    """vLLM renames rope_type 'yarn' to 'deepseek_yarn' in its copy of the config, from which the sampler's contract
    is computed: the same contract (YaRN's numbers included) as the trainer's config gives."""
    from rl.contract import config_contract
    from rl.testing import tiny_config

    config, renamed = tiny_config(ARCH), tiny_config(ARCH)
    renamed.rope_parameters = {**renamed.rope_parameters, "rope_type": "deepseek_yarn"}
    contract = config_contract(config, torch.bfloat16)
    assert contract["yarn"] is not None and contract["mla"].endswith("form=absorbed")
    assert config_contract(renamed, torch.bfloat16) == contract
