"""vLLM's unquantized linear layers on mok.linear (fp32 accumulation in a fixed order, one rounding).

Legend: T tokens, K input features, N output features.
"""
from __future__ import annotations

import torch

import mok

_method_class = None


def build_linear_method():
    """A fresh `MokLinearMethod` (a subclass of vLLM's UnquantizedLinearMethod, built on first use)."""
    global _method_class
    if _method_class is None:
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod

        class MokLinearMethod(UnquantizedLinearMethod):
            """y [..., N] = mok.linear(x [..., K], weight [N, K], bias [N]); the weight stays as loaded.

            vLLM's CPU method packs the weight for oneDNN and drops `layer.weight`; this one keeps it.
            The trace name is the layer's `_mok_name` (None: not traced).
            """

            def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
                return None

            def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
                return mok.linear(x, layer.weight, bias, name=getattr(layer, "_mok_name", None))

        _method_class = MokLinearMethod
    return _method_class()
