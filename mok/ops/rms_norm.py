"""mok.rms_norm: batch-invariant RMSNorm, optionally fused with the residual add.

Shapes: docs/shapes.md (x_TF: leading dims flattened into T, F the normalised features).
Semantics (Triton and CPU reference): fp32 math, ms = sum(x*x) / F in a fixed order that depends on
F only, rstd = 1 / sqrt(ms + eps), y = (x * rstd) * weight in fp32, one rounding to x's dtype.
With a residual: new_residual = (x + residual) computed in fp32 and rounded to x's dtype, and y is the
norm of new_residual (what vLLM's fused_add_rms_norm and transformers' decoder layers compute).
Backward: deterministic (CPU: sequential sums; CUDA: two Triton launches, each row's d x from that row
alone and the weight gradient from partial sums added in order, mok/kernels/rms_norm.py).
Each op's default implementation is the CPU reference (mok/reference/rms_norm.py); the CUDA kernel is
registered with register_kernel("cuda") (mok/kernels/rms_norm.py).
"""
from __future__ import annotations

import torch

from mok import hooks
from mok.errors import UnsupportedError
from mok.ops import dispatch
from mok.ops.checks import FLOAT_DTYPES, check_device, check_name, check_real, check_tensor
from mok.reference import rms_norm as reference


@torch.library.custom_op("mok::rms_norm", mutates_args=())
def _rms_norm_op(x_TF: torch.Tensor, weight_F: torch.Tensor, eps: float) -> torch.Tensor:
    check_device(x_TF, weight_F)
    return reference.rms_norm(x_TF, weight_F, eps).contiguous()


def _rms_norm_cuda(x_TF, weight_F, eps):
    check_device(x_TF, weight_F)
    from mok.kernels import rms_norm as kernels

    return kernels.rms_norm(x_TF, None, weight_F, eps)[0]


# Every implementation returns contiguous [T, F] tensors whatever x's strides; the fakes say the same.
@_rms_norm_op.register_fake
def _(x_TF, weight_F, eps):
    return x_TF.new_empty(x_TF.shape)


@torch.library.custom_op("mok::fused_add_rms_norm", mutates_args=())
def _fused_add_rms_norm_op(
    x_TF: torch.Tensor, residual_TF: torch.Tensor, weight_F: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    check_device(x_TF, residual_TF, weight_F)
    y_TF, new_residual_TF = reference.fused_add_rms_norm(x_TF, residual_TF, weight_F, eps)
    return y_TF.contiguous(), new_residual_TF.contiguous()


def _fused_add_rms_norm_cuda(x_TF, residual_TF, weight_F, eps):
    check_device(x_TF, residual_TF, weight_F)
    from mok.kernels import rms_norm as kernels

    return kernels.rms_norm(x_TF, residual_TF, weight_F, eps)


@_fused_add_rms_norm_op.register_fake
def _(x_TF, residual_TF, weight_F, eps):
    return x_TF.new_empty(x_TF.shape), x_TF.new_empty(x_TF.shape)


@torch.library.custom_op("mok::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(
    grad_TF: torch.Tensor, x_TF: torch.Tensor, weight_F: torch.Tensor, eps: float,
    grad_residual_TF: torch.Tensor | None, residual_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (d x [T, F] in x's dtype, d x in residual_dtype [T, F] (an empty [0, F] when residual_dtype is None),
    d weight [F] in weight's dtype). d x = the norm's fp32 gradient plus grad_residual_TF (when given, in fp32),
    rounded once to each dtype: the fused norm's d x and d residual (residual_dtype only when it differs from
    x's: outputs of an op may not alias). The roundings live in the op so that the CUDA kernel writes the
    rounded gradients directly (mok/kernels/rms_norm.py)."""
    grad_x_TF, grad_weight_F = reference.rms_norm_backward(grad_TF, x_TF, weight_F, eps)
    if grad_residual_TF is not None:
        grad_x_TF = grad_x_TF + grad_residual_TF.float()
    grad_x_TF = grad_x_TF.contiguous()
    grad_x2_TF = x_TF.new_empty(0, x_TF.shape[1]) if residual_dtype is None else grad_x_TF.to(residual_dtype)
    return grad_x_TF.to(x_TF.dtype), grad_x2_TF, grad_weight_F.to(weight_F.dtype)


def _rms_norm_backward_cuda(grad_TF, x_TF, weight_F, eps, grad_residual_TF, residual_dtype):
    from mok.kernels import rms_norm as kernels

    return kernels.rms_norm_backward(grad_TF, x_TF, weight_F, eps, grad_residual_TF, residual_dtype)


@_rms_norm_backward_op.register_fake
def _(grad_TF, x_TF, weight_F, eps, grad_residual_TF, residual_dtype):
    rows = 0 if residual_dtype is None else x_TF.shape[0]
    return (x_TF.new_empty(x_TF.shape), x_TF.new_empty((rows, x_TF.shape[1]), dtype=residual_dtype or x_TF.dtype),
            weight_F.new_empty(weight_F.shape))


def _setup_plain(ctx, inputs, output):
    x_TF, weight_F, eps = inputs
    ctx.save_for_backward(x_TF, weight_F)
    ctx.eps = eps


def _backward_plain(ctx, grad_TF):
    x_TF, weight_F = ctx.saved_tensors
    grad_x_TF, _, grad_weight_F = _rms_norm_backward(grad_TF.contiguous(), x_TF, weight_F, ctx.eps, None, None)
    return grad_x_TF, grad_weight_F, None


def _setup_fused(ctx, inputs, output):
    x_TF, residual_TF, weight_F, eps = inputs
    ctx.save_for_backward(output[1], weight_F)
    ctx.eps = eps
    ctx.dtypes = (x_TF.dtype, residual_TF.dtype)


def _backward_fused(ctx, grad_y_TF, grad_residual_TF):
    # An unused output's gradient comes materialised as zeros (autograd's default, kept on purpose): d x is then
    # d norm + 0.0, the bits this op has always given (a -0.0 becomes +0.0).
    new_residual_TF, weight_F = ctx.saved_tensors
    if grad_y_TF is None:
        grad_y_TF = torch.zeros_like(new_residual_TF)
    x_dtype, residual_dtype = ctx.dtypes
    other_dtype = None if residual_dtype == x_dtype else residual_dtype
    grad_x_TF, grad_x2_TF, grad_weight_F = _rms_norm_backward(
        grad_y_TF.contiguous(), new_residual_TF, weight_F, ctx.eps, grad_residual_TF, other_dtype)
    # One tensor for d x and d residual when they share a dtype (their values are equal), as AddBackward does.
    return grad_x_TF, grad_x_TF if other_dtype is None else grad_x2_TF, grad_weight_F, None


_rms_norm = dispatch.register(_rms_norm_op, cuda=_rms_norm_cuda, backward=_backward_plain, setup_context=_setup_plain,
                              native="rms_norm")
_fused_add_rms_norm = dispatch.register(_fused_add_rms_norm_op, cuda=_fused_add_rms_norm_cuda, backward=_backward_fused,
                                        setup_context=_setup_fused, native="fused_add_rms_norm")
_rms_norm_backward = dispatch.register(_rms_norm_backward_op, cuda=_rms_norm_backward_cuda)


def rms_norm(
    x_TF: torch.Tensor,
    weight_F: torch.Tensor,
    eps: float,
    residual_TF: torch.Tensor | None = None,
    *,
    name: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Batch-invariant RMSNorm over the last dim.

    x_TF: [..., F] float (fp32/bf16/fp16); weight_F: [F]; eps: float; residual_TF: None or like x
    (docs/shapes.md).
    Returns y [..., F] in x's dtype, or with a residual (y, new_residual), new_residual = x + residual
    rounded to x's dtype and y = rms_norm(new_residual). Differentiable (deterministic backward).
    `name`: when set and observed, emits (name, normalized row, "input") and (name, y, "output"); the
    normalized row is x, or the new residual when a residual is given: the row that alone determines y,
    so verify can align the op by content.
    """
    check_name(name, "rms_norm")
    if name is None or not hooks.observed():
        result = dispatch.native_call("rms_norm_call", x_TF, weight_F, eps, residual_TF)
        if result is not None:
            return result
    check_tensor(x_TF, "rms_norm: x")
    check_tensor(weight_F, "rms_norm: weight")
    if residual_TF is not None:
        check_tensor(residual_TF, "rms_norm: residual")
    if x_TF.dtype not in FLOAT_DTYPES or weight_F.dtype not in FLOAT_DTYPES:
        raise UnsupportedError(f"rms_norm: dtypes {x_TF.dtype}/{weight_F.dtype} not in {FLOAT_DTYPES}")
    if x_TF.dim() < 1 or x_TF.shape[-1] == 0:
        raise UnsupportedError(f"rms_norm: x must be [..., F] with F > 0, got {tuple(x_TF.shape)}")
    if weight_F.shape != x_TF.shape[-1:]:
        raise UnsupportedError(
            f"rms_norm: weight {tuple(weight_F.shape)} must be [{x_TF.shape[-1]}] for x {tuple(x_TF.shape)}")
    if residual_TF is not None and residual_TF.shape != x_TF.shape:
        raise UnsupportedError(f"rms_norm: residual {tuple(residual_TF.shape)} must match x {tuple(x_TF.shape)}")
    if residual_TF is not None and residual_TF.dtype not in FLOAT_DTYPES:
        raise UnsupportedError(f"rms_norm: residual dtype {residual_TF.dtype} not in {FLOAT_DTYPES}")
    check_device(x_TF, weight_F, *(() if residual_TF is None else (residual_TF,)))
    eps = check_real(eps, "rms_norm: eps", nonnegative=True)
    observed = name is not None and hooks.observed()
    shape = x_TF.shape
    if residual_TF is None:
        y_TF = dispatch.shaped(_rms_norm(dispatch.rows(x_TF), weight_F, eps), shape)
        result = y_TF
    else:
        y_flat_TF, new_residual_flat_TF = _fused_add_rms_norm(dispatch.rows(x_TF), dispatch.rows(residual_TF),
                                                              weight_F, eps)
        y_TF = dispatch.shaped(y_flat_TF, shape)
        result = (y_TF, dispatch.shaped(new_residual_flat_TF, shape))
    if observed:
        hooks.emit(name, x_TF if residual_TF is None else result[1], "input")
        hooks.emit(name, y_TF, "output")
    return result
