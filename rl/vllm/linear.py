"""vLLM's unquantized linear layers on mok.linear (fp32 accumulation in a fixed order, one rounding).

Shapes: docs/shapes.md.
"""
from __future__ import annotations

import torch

import mok
from rl.vllm.vllm_internals import UnquantizedLinearMethod


class MokLinearMethod(UnquantizedLinearMethod):
    """y [..., O] = mok.linear(x [..., F], weight [O, F], bias [O]); the weight stays as loaded.

    vLLM's CPU method packs the weight for oneDNN and drops `layer.weight`; this one keeps it.
    The trace name is the layer's `mok_trace_name` (None: not traced).
    """

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        return None

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return mok.linear(x, layer.weight, bias, name=getattr(layer, "mok_trace_name", None))
