"""Triton RMSNorm (optionally fused with the residual add) behind mok.rms_norm.

Legend: T rows, D features. One program per row holds the whole row (BLOCK_D = next power of two of
D), so the sum of squares is one tl.sum whose order depends on D only: batch-invariant. Semantics in
mok/reference/rms_norm.py (fp32 math, weight multiply in fp32, one rounding).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, y_ptr, new_residual_ptr,
    D, stride_x, stride_r, stride_y, stride_nr, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        h = (x + r).to(new_residual_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * stride_nr + offs, h, mask=mask)
        x = h.to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / D
    rstd = tl.div_rn(1.0, tl.sqrt_rn(mean_square + eps))
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (x * rstd) * w
    tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_config(d: int) -> dict:
    block_d = triton.next_power_of_2(d)
    return dict(BLOCK_D=block_d, num_warps=4 if block_d <= 1024 else (8 if block_d <= 4096 else 16))


def rms_norm(
    x_TD: torch.Tensor, residual_TD: torch.Tensor | None, weight_D: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (y [T, D] in x's dtype, new_residual [T, D] or None). Rows may be strided; last dim contiguous."""
    x_TD = x_TD if x_TD.stride(-1) == 1 else x_TD.contiguous()
    weight_D = weight_D.contiguous()
    t, d = x_TD.shape
    y_TD = torch.empty(t, d, dtype=x_TD.dtype, device=x_TD.device)
    new_residual_TD = None
    if residual_TD is not None:
        residual_TD = residual_TD if residual_TD.stride(-1) == 1 else residual_TD.contiguous()
        new_residual_TD = torch.empty_like(y_TD)
    if t:
        _rms_norm_kernel[(t,)](
            x_TD, residual_TD if residual_TD is not None else x_TD, weight_D, y_TD,
            new_residual_TD if new_residual_TD is not None else y_TD,
            d, x_TD.stride(0), (residual_TD if residual_TD is not None else x_TD).stride(0), y_TD.stride(0),
            (new_residual_TD if new_residual_TD is not None else y_TD).stride(0), eps,
            HAS_RESIDUAL=residual_TD is not None, **rms_norm_config(d),
        )
    return y_TD, new_residual_TD
