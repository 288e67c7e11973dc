"""Triton RMSNorm (optionally fused with the residual add) behind mok.rms_norm.

Shapes: docs/shapes.md. One program per row holds the whole row (BLOCK_F = next power of two of F),
so the sum of squares is one tl.sum whose order depends on F only: batch-invariant. Semantics in
mok/reference/rms_norm.py (fp32 math, weight multiply in fp32, one rounding).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, y_ptr, new_residual_ptr,
    F, stride_x, stride_r, stride_y, stride_nr, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_F: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_F)
    mask = offs < F
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        h = (x + r).to(new_residual_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * stride_nr + offs, h, mask=mask)
        x = h.to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / F
    rstd = tl.div_rn(1.0, tl.sqrt_rn(mean_square + eps))
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (x * rstd) * w
    tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_config(num_features: int) -> dict:
    """The one place the configuration is chosen: from F only."""
    block_f = triton.next_power_of_2(num_features)
    return dict(BLOCK_F=block_f, num_warps=4 if block_f <= 1024 else (8 if block_f <= 4096 else 16))


def rms_norm(
    x_TF: torch.Tensor, residual_TF: torch.Tensor | None, weight_F: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (y [T, F] in x's dtype, new_residual [T, F] or None). Rows may be strided; last dim contiguous."""
    x_TF = x_TF if x_TF.stride(-1) == 1 else x_TF.contiguous()
    weight_F = weight_F.contiguous()
    num_rows, num_features = x_TF.shape
    y_TF = torch.empty(num_rows, num_features, dtype=x_TF.dtype, device=x_TF.device)
    new_residual_TF = None
    if residual_TF is not None:
        residual_TF = residual_TF if residual_TF.stride(-1) == 1 else residual_TF.contiguous()
        new_residual_TF = torch.empty_like(y_TF)
    if num_rows:
        _rms_norm_kernel[(num_rows,)](
            x_TF, residual_TF if residual_TF is not None else x_TF, weight_F, y_TF,
            new_residual_TF if new_residual_TF is not None else y_TF,
            num_features, x_TF.stride(0), (residual_TF if residual_TF is not None else x_TF).stride(0), y_TF.stride(0),
            (new_residual_TF if new_residual_TF is not None else y_TF).stride(0), eps,
            HAS_RESIDUAL=residual_TF is not None, **rms_norm_config(num_features),
        )
    return y_TF, new_residual_TF
