"""CPU reference of mok.rms_norm (forward and backward).

Legend: T rows (leading dims flattened), D normalised features.
Forward semantics (shared with the Triton kernel): in fp32, ms = (sum_d x*x) / D with the sum in a
fixed order, rstd = 1 / sqrt(ms + eps), y = (x * rstd) * w, one rounding to x's dtype.
"""
from __future__ import annotations

import torch

from mok.reference.linear import sum_rows
from mok.reference.reduce import sum_last


def rstd(x_TD: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(x^2) + eps) per row in fp32, sum over D sequential. [T, D] -> fp32 [T]."""
    x_TD = x_TD.float()
    mean_square_T = sum_last(x_TD * x_TD) / x_TD.shape[-1]
    return 1.0 / torch.sqrt(mean_square_T + eps)


def rms_norm(x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """[T, D] -> [T, D] in x's dtype."""
    x_f32_TD = x_TD.float()
    return ((x_f32_TD * rstd(x_f32_TD, eps)[:, None]) * weight_D.float()).to(x_TD.dtype)


def fused_add_rms_norm(
    x_TD: torch.Tensor, residual_TD: torch.Tensor, weight_D: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """new_residual = (x + residual) in fp32 rounded to x's dtype; y = rms_norm(new_residual)."""
    new_residual_TD = (x_TD.float() + residual_TD.float()).to(x_TD.dtype)
    return rms_norm(new_residual_TD, weight_D, eps), new_residual_TD


def rms_norm_backward(
    grad_TD: torch.Tensor, x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of rms_norm w.r.t. x and weight, fp32 [T, D] and fp32 [D]; sums in fixed order."""
    x_TD = x_TD.float()
    rstd_T1 = rstd(x_TD, eps)[:, None]
    grad_w_TD = grad_TD.float() * weight_D.float()
    dot_T1 = sum_last(grad_w_TD * x_TD)[:, None]
    grad_x_TD = rstd_T1 * grad_w_TD - x_TD * (rstd_T1 * rstd_T1 * rstd_T1) * (dot_T1 / x_TD.shape[-1])
    grad_weight_D = sum_rows(grad_TD.float() * (x_TD * rstd_T1))
    return grad_x_TD, grad_weight_D
