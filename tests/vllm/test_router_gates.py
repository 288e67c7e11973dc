"""A MoE router gate vLLM builds as a plain torch.nn.Linear (GLM-4.5's fp32 gate in vLLM 0.26.0, the GPU's version):
the plugin converts it when its block is built, and it computes the trainer's router logits (rl/models/decoder.py)."""
from __future__ import annotations

import pytest
import torch

import mok

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("tokens, hidden, experts", [(1, 64, 8), (37, 96, 160), (300, 5, 3)])
def test_converted_gate_has_the_trainers_router_bits(tokens, hidden, experts):
    from rl.vllm.moe import MokRouterLinear, as_router_gate

    gate = torch.nn.Linear(hidden, experts, bias=False, dtype=torch.float32)
    gate.e_score_correction_bias = torch.nn.Parameter(torch.randn(experts))  # as glm4_moe.py hangs it there
    weight, bias = gate.weight, gate.e_score_correction_bias
    as_router_gate(gate, "model.layers.3.mlp.gate")
    assert type(gate) is MokRouterLinear and gate.mok_trace_name == "layers.3.router"
    assert gate.weight is weight and gate.e_score_correction_bias is bias
    x_TH = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens)).to(torch.bfloat16)
    logits_TE = gate(x_TH)
    assert logits_TE.dtype == torch.float32 and logits_TE.shape == (tokens, experts)
    assert torch.equal(logits_TE, mok.linear(x_TH.float(), weight.float()))


class _Glm4MoE(torch.nn.Module):
    """glm4_moe.Glm4MoE's constructor signature and its plain fp32 gate, as vLLM 0.26.0 builds them."""

    def __init__(self, config, quant_config=None, prefix: str = "", enable_eplb: bool = False):
        super().__init__()
        self.gate = torch.nn.Linear(8, 4, bias=False, dtype=torch.float32)


@pytest.mark.parametrize("version, converts", [("0.26.0", True), ("0.32.0", False)])
def test_plain_gates_are_converted_when_their_block_is_built(monkeypatch, version, converts):
    from vllm.model_executor.models import glm4_moe

    from rl.vllm import vllm_internals

    monkeypatch.setattr(vllm_internals, "VERSION", version)
    monkeypatch.setattr(glm4_moe, "Glm4MoE", _Glm4MoE)
    monkeypatch.setattr(_Glm4MoE, "__init__", _Glm4MoE.__init__)  # restored after the wrapping below
    seen = []
    vllm_internals.on_plain_router_gates(lambda gate, prefix: seen.append((type(gate), prefix)))
    vllm_internals.on_plain_router_gates(lambda gate, prefix: seen.append("twice"))  # plugins may load twice
    _Glm4MoE(None, prefix="model.layers.1.mlp")
    _Glm4MoE(None, None, "model.layers.2.mlp")
    _Glm4MoE(None)
    expected = [(torch.nn.Linear, "model.layers.1.mlp.gate"), (torch.nn.Linear, "model.layers.2.mlp.gate"),
                (torch.nn.Linear, "gate")]
    assert seen == (expected if converts else [])
