"""Triton SiluAndMul behind mok.silu_and_mul, forward and backward. Shapes: docs/shapes.md.

Element-wise (batch-invariant by construction). silu(gate) is evaluated in fp64 and rounded to fp32,
as on the CPU path (mok/reference/silu_and_mul.py); the product with up is fp32, one rounding.
The backward is the reference's formula with sigmoid(gate) evaluated the same way (fp64, rounded to fp32),
fp32 products, each gradient rounded once to x's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok.kernels.launch import cached_launch
from mok.kernels.layout import last_dim_contiguous


@cached_launch
@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, I, stride_x, stride_o, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0).to(tl.float64)
    up = tl.load(x_ptr + t * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


@cached_launch
@triton.jit
def _silu_and_mul_backward_kernel(grad_ptr, x_ptr, out_ptr, I, stride_g, stride_x, stride_o, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate64 = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0).to(tl.float64)
    up = tl.load(x_ptr + t * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    grad = tl.load(grad_ptr + t * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    sig = (1.0 / (1.0 + tl.exp(-gate64))).to(tl.float32)
    gate = gate64.to(tl.float32)
    grad_gate = grad * up * (sig * (1.0 + gate * (1.0 - sig)))
    grad_up = grad * (gate * sig)
    tl.store(out_ptr + t * stride_o + offs, grad_gate.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + t * stride_o + I + offs, grad_up.to(out_ptr.dtype.element_ty), mask=mask)


def _block(inter: int) -> int:
    return min(1024, triton.next_power_of_2(inter))


def silu_and_mul(x_T2I: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I] in x's dtype."""
    x_T2I = last_dim_contiguous(x_T2I)
    num_tokens, inter = x_T2I.shape[0], x_T2I.shape[1] // 2
    out_TI = torch.empty(num_tokens, inter, dtype=x_T2I.dtype, device=x_T2I.device)
    if out_TI.numel():
        block = _block(inter)
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
            x_T2I, out_TI, inter, x_T2I.stride(0), out_TI.stride(0), BLOCK=block, num_warps=4)
    return out_TI


def silu_and_mul_backward(grad_TI: torch.Tensor, x_T2I: torch.Tensor) -> torch.Tensor:
    """grad [T, I], x [T, 2I] (rows may be strided) -> d x [T, 2I] in x's dtype (d gate, then d up)."""
    grad_TI, x_T2I = last_dim_contiguous(grad_TI), last_dim_contiguous(x_T2I)
    num_tokens, inter = x_T2I.shape[0], x_T2I.shape[1] // 2
    grad_x_T2I = torch.empty(num_tokens, 2 * inter, dtype=x_T2I.dtype, device=x_T2I.device)
    if grad_x_T2I.numel():
        block = _block(inter)
        _silu_and_mul_backward_kernel[(num_tokens, triton.cdiv(inter, block))](
            grad_TI, x_T2I, grad_x_T2I, inter, grad_TI.stride(0), x_T2I.stride(0), grad_x_T2I.stride(0),
            BLOCK=block, num_warps=4)
    return grad_x_T2I
