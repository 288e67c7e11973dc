"""mok.silu_and_mul: SwiGLU activation silu(gate) * up, gate = first half of the last dim.

Shapes: docs/shapes.md (x_T2I: leading dims flattened into T).
Semantics: fp32 math, one rounding to x's dtype (mok/reference/silu_and_mul.py). Element-wise, so
batch-invariant by construction; the backward is element-wise too (deterministic).
Each op's default implementation is the CPU reference; the CUDA kernels are registered with
register_kernel("cuda") (mok/kernels/silu_and_mul.py, forward and backward).
"""
from __future__ import annotations

import torch

from mok import hooks
from mok.errors import UnsupportedError
from mok.ops import dispatch
from mok.ops.checks import FLOAT_DTYPES, check_device, check_name, check_tensor
from mok.reference import silu_and_mul as reference


@torch.library.custom_op("mok::silu_and_mul", mutates_args=())
def _silu_and_mul_op(x_T2I: torch.Tensor) -> torch.Tensor:
    check_device(x_T2I)
    return reference.silu_and_mul(x_T2I)


def _silu_and_mul_cuda(x_T2I):
    from mok.kernels import silu_and_mul as kernels

    return kernels.silu_and_mul(x_T2I)


@_silu_and_mul_op.register_fake
def _(x_T2I):
    return x_T2I.new_empty(x_T2I.shape[0], x_T2I.shape[1] // 2)


@torch.library.custom_op("mok::silu_and_mul_backward", mutates_args=())
def _silu_and_mul_backward_op(grad_TI: torch.Tensor, x_T2I: torch.Tensor) -> torch.Tensor:
    """-> [T, 2I] in x's dtype (d gate, d up), computed in fp32 and rounded once."""
    return reference.silu_and_mul_backward(grad_TI, x_T2I).to(x_T2I.dtype)


def _silu_and_mul_backward_cuda(grad_TI, x_T2I):
    from mok.kernels import silu_and_mul as kernels

    return kernels.silu_and_mul_backward(grad_TI, x_T2I)


@_silu_and_mul_backward_op.register_fake
def _(grad_TI, x_T2I):
    return x_T2I.new_empty(x_T2I.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward(ctx, grad_TI):
    (x_T2I,) = ctx.saved_tensors
    return _silu_and_mul_backward(grad_TI.contiguous(), x_T2I)


_silu_and_mul = dispatch.register(_silu_and_mul_op, cuda=_silu_and_mul_cuda, backward=_backward,
                                  setup_context=_setup_context)
_silu_and_mul_backward = dispatch.register(_silu_and_mul_backward_op, cuda=_silu_and_mul_backward_cuda)


def silu_and_mul(x_T2I: torch.Tensor, *, name: str | None = None) -> torch.Tensor:
    """silu(x[..., :I]) * x[..., I:].

    x_T2I: [..., 2I] float (fp32/bf16/fp16). Returns [..., I] in x's dtype. Differentiable.
    `name`: when set and observed, emits (name, x, "input") and (name, out, "output").
    """
    check_name(name, "silu_and_mul")
    check_tensor(x_T2I, "silu_and_mul: x")
    check_device(x_T2I)
    if x_T2I.dtype not in FLOAT_DTYPES:
        raise UnsupportedError(f"silu_and_mul: dtype {x_T2I.dtype} not in {FLOAT_DTYPES}")
    if x_T2I.dim() < 1 or x_T2I.shape[-1] % 2:
        raise UnsupportedError(f"silu_and_mul: last dim of {tuple(x_T2I.shape)} must be even (gate, then up)")
    observed = name is not None and hooks.observed()
    if observed:
        hooks.emit(name, x_T2I, "input")
    shape = x_T2I.shape
    out = dispatch.shaped(_silu_and_mul(dispatch.rows(x_T2I).contiguous()), (*shape[:-1], shape[-1] // 2))
    if observed:
        hooks.emit(name, out, "output")
    return out
