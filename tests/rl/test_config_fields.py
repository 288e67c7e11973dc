"""Every config field that changes the math and whose value mok does not implement is refused at wrap
time, naming the field and the value (rl.models.base.CONFIG_FIELDS); the values mok implements wrap."""
from __future__ import annotations

import pytest
import torch

import rl
from rl.models.base import CONFIG_FIELDS
from rl.testing import ARCHITECTURES, WHOLE_HEAD_ROTARY, tiny_config, tiny_model

REFUSED = [
    # sliding windows: Mixtral reads sliding_window directly (the bug: it was computed as full attention)
    ("mixtral", {"sliding_window": 4}, "sliding_window", "4"),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 16}, "sliding_window", "16"),
    ("olmoe", {"sliding_window": 8}, "sliding_window", "8"),
    ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2}, "layer_types",
     "sliding_attention"),
    ("qwen2_moe", {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 16}, "layer_types",
     "sliding_attention"),
    # rope types other than the default, in any architecture
    *[(arch, {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, "rope_parameters",
       "linear") for arch in ARCHITECTURES],
    ("mixtral", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                     "original_max_position_embeddings": 128}}, "rope_parameters", "yarn"),
    # activations other than SwiGLU's silu
    *[(arch, {"hidden_act": "gelu"}, "hidden_act", "gelu") for arch in ARCHITECTURES],
    # dropout inside attention, router jitter, router logits / auxiliary loss in the returned loss
    *[(arch, {"attention_dropout": 0.1}, "attention_dropout", "0.1") for arch in ARCHITECTURES],
    *[(arch, {"output_router_logits": True}, "output_router_logits", "True") for arch in ARCHITECTURES],
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise", "0.1"),
    # a partial rotary: these architectures' transformers code rotates the whole head whatever the field says
    *[(arch, {"partial_rotary_factor": 0.5}, "rope_parameters", "partial_rotary_factor")
      for arch in WHOLE_HEAD_ROTARY],
]


@pytest.mark.parametrize("arch, overrides, field, value", REFUSED,
                         ids=[f"{a}-{f}-{v}" for a, _, f, v in REFUSED])
def test_unimplemented_config_values_are_refused_naming_field_and_value(arch, overrides, field, value):
    model = tiny_model(arch, **overrides)
    with pytest.raises(rl.UnsupportedModelError, match=rf"config\.{field}=.*{value}") as caught:
        rl.wrap(model)
    assert arch in str(caught.value)
    with pytest.raises(rl.UnsupportedModelError):  # the other entry points refuse it too
        rl.logprobs(model, torch.ones(1, 3, dtype=torch.int64))
    with pytest.raises(rl.UnsupportedModelError):
        rl.contract(model)


def test_a_field_set_after_construction_is_seen():
    """Configs are read at wrap time, not only through the config class's __init__ (which rewrites some)."""
    model = tiny_model("qwen3_moe")
    model.config.sliding_window = 8
    with pytest.raises(rl.UnsupportedModelError, match="sliding_window=8"):
        rl.wrap(model)


def test_mixtral_sliding_window_would_change_the_logits():
    """Why it is refused: transformers' Mixtral computes a different function with a window set."""
    input_ids = torch.randint(3, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = tiny_model("mixtral", seed=0, dtype=torch.float32)(input_ids).logits
        windowed = tiny_model("mixtral", seed=0, dtype=torch.float32, sliding_window=4)(input_ids).logits
    torch.testing.assert_close(full[:, :4], windowed[:, :4], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(full[:, 4:], windowed[:, 4:], atol=1e-3)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_default_tiny_configs_pass_the_table(arch):
    assert set(CONFIG_FIELDS) == set(ARCHITECTURES)
    config = tiny_config(arch)
    from rl.models.base import check_config

    check_config(arch, config)
    assert rl.wrap(tiny_model(arch)) is not None


@pytest.mark.parametrize("arch, overrides", [
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": None}),  # no window: full attention
    ("qwen3_moe", {"attention_bias": True}),
    ("olmoe", {"attention_bias": True, "clip_qkv": 1.0}),
    ("qwen2_moe", {"use_sliding_window": False, "max_window_layers": 0}),
    ("qwen3_moe", {"decoder_sparse_step": 2}),
    ("mixtral", {"tie_word_embeddings": True}),
    ("qwen3_moe", {"attention_dropout": 0.0, "output_router_logits": False, "router_aux_loss_coef": 0.5}),
])
def test_implemented_values_wrap_and_match_transformers(arch, overrides):
    model = tiny_model(arch, seed=4, dtype=torch.float32, **overrides)
    input_ids = torch.randint(3, 512, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(input_ids).logits
        got = rl.wrap(model)(input_ids).logits
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("arch", WHOLE_HEAD_ROTARY)
def test_transformers_ignores_partial_rotary_factor_here(arch):
    """Why it is refused rather than applied: transformers' code of these architectures gives the same logits with
    and without the field, so a trainer applying it would compute another function than the reference."""
    input_ids = torch.randint(3, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = tiny_model(arch, seed=0, dtype=torch.float32)(input_ids).logits
        partial = tiny_model(arch, seed=0, dtype=torch.float32, partial_rotary_factor=0.5)(input_ids).logits
    assert torch.equal(whole, partial)


def test_tied_embeddings_read_the_shared_weight():
    model = rl.wrap(tiny_model("mixtral", tie_word_embeddings=True))
    from rl.models import adapter_for

    adapter = adapter_for(model)
    assert adapter.lm_head.weight is adapter.embed.weight
