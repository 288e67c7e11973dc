"""CPU reference of mok.silu_and_mul. Shapes: docs/shapes.md (x_T2I: leading dims flattened into T).

Semantics: out = silu(gate) * up in fp32 with gate = x[..., :I], up = x[..., I:], silu of the fp32
gate rounded to fp32 (position-independent, mok.reference.elementwise), one rounding to x's dtype.
"""
from __future__ import annotations

import torch

from mok.reference import elementwise


def silu_and_mul(x_T2I: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I] in x's dtype."""
    inter = x_T2I.shape[-1] // 2
    gate_TI, up_TI = x_T2I[..., :inter].float(), x_T2I[..., inter:].float()
    return (elementwise.silu(gate_TI) * up_TI).to(x_T2I.dtype)


def silu_and_mul_backward(grad_TI: torch.Tensor, x_T2I: torch.Tensor) -> torch.Tensor:
    """fp32 [T, 2I] gradient (d gate, d up)."""
    inter = x_T2I.shape[-1] // 2
    gate_TI, up_TI = x_T2I[..., :inter].float(), x_T2I[..., inter:].float()
    sig_TI = elementwise.sigmoid(gate_TI)
    grad_TI = grad_TI.float()
    grad_gate_TI = grad_TI * up_TI * (sig_TI * (1.0 + gate_TI * (1.0 - sig_TI)))
    grad_up_TI = grad_TI * (gate_TI * sig_TI)
    return torch.cat([grad_gate_TI, grad_up_TI], dim=-1)
