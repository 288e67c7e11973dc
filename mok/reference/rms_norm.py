"""CPU reference of mok.rms_norm (forward and backward).

Shapes: docs/shapes.md (x_TF: T rows, leading dims flattened; F normalised features).
Forward semantics (shared with the Triton kernel): in fp32, ms = (sum_f x*x) / F with the sum in a
fixed order, rstd = 1 / sqrt(ms + eps), y = (x * rstd) * w, one rounding to x's dtype.
"""
from __future__ import annotations

import torch

from mok.reference.linear import sum_rows
from mok.reference.reduce import sum_last


def rstd(x_TF: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(x^2) + eps) per row in fp32, sum over F sequential. [T, F] -> fp32 [T]."""
    x_TF = x_TF.float()
    mean_square_T = sum_last(x_TF * x_TF) / x_TF.shape[-1]
    return 1.0 / torch.sqrt(mean_square_T + eps)


def rms_norm(x_TF: torch.Tensor, weight_F: torch.Tensor, eps: float) -> torch.Tensor:
    """[T, F] -> [T, F] in x's dtype."""
    x_f32_TF = x_TF.float()
    return ((x_f32_TF * rstd(x_f32_TF, eps)[:, None]) * weight_F.float()).to(x_TF.dtype)


def fused_add_rms_norm(
    x_TF: torch.Tensor, residual_TF: torch.Tensor, weight_F: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """new_residual = (x + residual) in fp32 rounded to x's dtype; y = rms_norm(new_residual)."""
    new_residual_TF = (x_TF.float() + residual_TF.float()).to(x_TF.dtype)
    return rms_norm(new_residual_TF, weight_F, eps), new_residual_TF


def rms_norm_backward(
    grad_TF: torch.Tensor, x_TF: torch.Tensor, weight_F: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of rms_norm w.r.t. x and weight, fp32 [T, F] and fp32 [F]; sums in fixed order."""
    x_TF = x_TF.float()
    rstd_T1 = rstd(x_TF, eps)[:, None]
    grad_w_TF = grad_TF.float() * weight_F.float()
    dot_T1 = sum_last(grad_w_TF * x_TF)[:, None]
    grad_x_TF = rstd_T1 * grad_w_TF - x_TF * (rstd_T1 * rstd_T1 * rstd_T1) * (dot_T1 / x_TF.shape[-1])
    grad_weight_F = sum_rows(grad_TF.float() * (x_TF * rstd_T1))
    return grad_x_TF, grad_weight_F
