"""The rotary Triton kernel as it was before the cos/sin table (mok/kernels/rotary.py up to 2026-12-01),
verbatim: cos/sin evaluated per token in fp64 from fp32(position) * inv_freq. The bits the table path must
keep: tests/mok/test_rotary_table.py (interpreter) and tests/mok/test_dense_gpu.py (GPU) compare
mok.kernels.rotary.rotary with it, forward (inverse=False) and backward (inverse=True, what mok.rotary's
autograd runs on the gradient).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(
    x_ptr, out_ptr, positions_ptr, inv_freq_ptr,
    num_heads, half, stride_xt, stride_xh, stride_ot, stride_oh, sin_sign,
    NEOX: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    f = tl.arange(0, BLOCK_HALF)
    f_ok = f < half
    position = tl.load(positions_ptr + t).to(tl.float32)
    angle = (position * tl.load(inv_freq_ptr + f, mask=f_ok, other=0.0)).to(tl.float64)
    cos = tl.cos(angle).to(tl.float32)[None, :]
    sin = (tl.sin(angle).to(tl.float32) * sin_sign)[None, :]
    h = tl.arange(0, BLOCK_HEADS)
    mask = (h < num_heads)[:, None] & f_ok[None, :]
    if NEOX:
        i1 = f
        i2 = f + half
    else:
        i1 = 2 * f
        i2 = 2 * f + 1
    x_base = x_ptr + t * stride_xt + h[:, None] * stride_xh
    o_base = out_ptr + t * stride_ot + h[:, None] * stride_oh
    x1 = tl.load(x_base + i1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_base + i2[None, :], mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
    tl.store(o_base + i1[None, :], out1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_base + i2[None, :], out2.to(out_ptr.dtype.element_ty), mask=mask)


def rotary(
    x_TQD: torch.Tensor, positions_T: torch.Tensor, theta: float, rotary_dim: int, neox_style: bool, inverse: bool
) -> torch.Tensor:
    """[T, Q, D] -> [T, Q, D] in x's dtype; features past rotary_dim are copied."""
    from mok.kernels.rotary import _inv_freq

    x_TQD = x_TQD if x_TQD.stride(-1) == 1 else x_TQD.contiguous()
    num_tokens, num_heads, head_dim = x_TQD.shape
    out_TQD = torch.empty_like(x_TQD) if rotary_dim == head_dim else x_TQD.clone()
    if num_tokens and num_heads:
        half = rotary_dim // 2
        _rotary_kernel[(num_tokens,)](
            x_TQD, out_TQD, positions_T.contiguous(), _inv_freq(theta, rotary_dim, x_TQD.device),
            num_heads, half, x_TQD.stride(0), x_TQD.stride(1), out_TQD.stride(0), out_TQD.stride(1),
            -1.0 if inverse else 1.0,
            NEOX=neox_style, BLOCK_HEADS=triton.next_power_of_2(num_heads), BLOCK_HALF=triton.next_power_of_2(half),
            num_warps=4,
        )
    return out_TQD
