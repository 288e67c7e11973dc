"""rl/trace_names.py: the names of traced ops, their order, and vLLM module paths mapped to them; and
the trainer records exactly those names, in that order."""
from __future__ import annotations

import torch

import rl
from mok import hooks
from rl import trace_names
from rl.testing import tiny_model


def test_names_and_order():
    assert trace_names.layer(3, trace_names.MOE) == "layers.3.moe"
    assert trace_names.split("layers.12.post_attention_norm") == (12, "post_attention_norm")
    assert trace_names.split("lm_head") == (None, "lm_head")
    assert trace_names.split("layers.x.moe") == (None, "layers.x.moe")
    assert trace_names.layer_ops(routes=True) == ("input_norm", "qkv", "attention", "o_proj", "post_attention_norm",
                                                  "router", "routes", "moe")
    assert trace_names.in_order(1) == ("embed", "layers.0.input_norm", "layers.0.qkv", "layers.0.attention",
                                       "layers.0.o_proj", "layers.0.post_attention_norm", "layers.0.router",
                                       "layers.0.moe", "final_norm", "lm_head", "logprobs")
    per_row = trace_names.in_order(2, routes=True, per_row=True)
    assert "layers.1.attention" not in per_row and "logprobs" not in per_row and "layers.1.routes" in per_row
    assert per_row.index("layers.0.moe") < per_row.index("layers.1.input_norm") < per_row.index("final_norm")
    assert trace_names.per_row_globs() == ("embed", "layers.*.input_norm", "layers.*.qkv", "layers.*.o_proj",
                                           "layers.*.post_attention_norm", "layers.*.router", "layers.*.moe",
                                           "final_norm", "lm_head")


def test_vllm_module_paths():
    expected = {
        "model.embed_tokens": "embed",
        "model.layers.3.input_layernorm": "layers.3.input_norm",
        "model.layers.3.self_attn.qkv_proj": "layers.3.qkv",
        "model.layers.0.self_attn.attn": "layers.0.attention",
        "model.layers.0.self_attn.o_proj": "layers.0.o_proj",
        "model.layers.11.post_attention_layernorm": "layers.11.post_attention_norm",
        "model.layers.12.mlp.gate": "layers.12.router",
        "model.layers.1.block_sparse_moe.gate": "layers.1.router",  # Mixtral
        "model.layers.3.mlp.experts": "layers.3.moe",
        "model.norm": "final_norm",
        "lm_head": "lm_head",
        # not traced, as in the trainer
        "model.layers.0.self_attn.q_norm": None,
        "model.layers.0.mlp.gate_up_proj": None,
        "model.layers.0.mlp.shared_expert_gate": None,
        "model.layers.0.mlp.shared_expert.down_proj": None,
        "": None,
    }
    assert {path: trace_names.from_vllm_module(path) for path in expected} == expected
    assert trace_names.layer_index("model.layers.3.mlp.experts") == 3
    assert trace_names.layer_index("model.norm") is None


def test_the_trainer_records_the_names_in_order():
    model = rl.wrap(tiny_model("qwen3_moe", seed=0))
    seen = []
    with hooks.observe(lambda name, tensor, kind: seen.append(name)), torch.no_grad():
        rl.logprobs(model, torch.tensor([[5, 6, 7, 8]]))
    recorded = list(dict.fromkeys(seen))
    assert recorded == list(trace_names.in_order(model.config.num_hidden_layers))
