"""Triton SiluAndMul behind mok.silu_and_mul. Shapes: docs/shapes.md.

Element-wise (batch-invariant by construction). silu(gate) is evaluated in fp64 and rounded to fp32,
as on the CPU path (mok/reference/silu_and_mul.py); the product with up is fp32, one rounding.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, I, stride_x, stride_o, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0).to(tl.float64)
    up = tl.load(x_ptr + t * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x_T2I: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I] in x's dtype."""
    x_T2I = x_T2I if x_T2I.stride(-1) == 1 else x_T2I.contiguous()
    num_tokens, inter = x_T2I.shape[0], x_T2I.shape[1] // 2
    out_TI = torch.empty(num_tokens, inter, dtype=x_T2I.dtype, device=x_T2I.device)
    if out_TI.numel():
        block = min(1024, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
            x_T2I, out_TI, inter, x_T2I.stride(0), out_TI.stride(0), BLOCK=block, num_warps=4)
    return out_TI
