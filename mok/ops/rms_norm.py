"""mok.rms_norm: batch-invariant RMSNorm, optionally fused with the residual add.

Legend: T rows (leading dims flattened), D normalised features.
Semantics (Triton and CPU reference): fp32 math, ms = sum(x*x) / D in a fixed order that depends on
D only, rstd = 1 / sqrt(ms + eps), y = (x * rstd) * weight in fp32, one rounding to x's dtype.
With a residual: new_residual = (x + residual) computed in fp32 and rounded to x's dtype, and y is the
norm of new_residual (what vLLM's fused_add_rms_norm and transformers' decoder layers compute).
Backward: deterministic (CPU: sequential sums; CUDA: torch element-wise ops and fixed-shape sums).
"""
from __future__ import annotations

import torch

from mok import hooks
from mok.errors import UnsupportedError
from mok.ops.linear import FLOAT_DTYPES, _check_device


def _rms_norm_backward_f32(grad_TD, x_TD, weight_D, eps):
    if x_TD.device.type == "cuda":
        x = x_TD.float()
        rstd_T1 = 1.0 / torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + eps)
        grad_w_TD = grad_TD.float() * weight_D.float()
        dot_T1 = (grad_w_TD * x).sum(-1, keepdim=True)
        grad_x = rstd_T1 * grad_w_TD - x * (rstd_T1 * rstd_T1 * rstd_T1) * (dot_T1 / x.shape[-1])
        grad_weight = (grad_TD.float() * (x * rstd_T1)).sum(0)
        return grad_x, grad_weight
    from mok.reference import rms_norm as reference

    return reference.rms_norm_backward(grad_TD, x_TD, weight_D, eps)


@torch.library.custom_op("mok::rms_norm", mutates_args=())
def _rms_norm_op(x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    if _check_device(x_TD, weight_D) == "cuda":
        from mok.kernels import rms_norm as kernels

        return kernels.rms_norm(x_TD, None, weight_D, eps)[0]
    from mok.reference import rms_norm as reference

    return reference.rms_norm(x_TD, weight_D, eps)


@_rms_norm_op.register_fake
def _(x_TD, weight_D, eps):
    return torch.empty_like(x_TD)


@torch.library.custom_op("mok::fused_add_rms_norm", mutates_args=())
def _fused_add_rms_norm_op(
    x_TD: torch.Tensor, residual_TD: torch.Tensor, weight_D: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if _check_device(x_TD, residual_TD, weight_D) == "cuda":
        from mok.kernels import rms_norm as kernels

        return kernels.rms_norm(x_TD, residual_TD, weight_D, eps)
    from mok.reference import rms_norm as reference

    return reference.fused_add_rms_norm(x_TD, residual_TD, weight_D, eps)


@_fused_add_rms_norm_op.register_fake
def _(x_TD, residual_TD, weight_D, eps):
    return torch.empty_like(x_TD), torch.empty_like(x_TD)


@torch.library.custom_op("mok::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(
    grad_TD: torch.Tensor, x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rms_norm_backward_f32(grad_TD, x_TD, weight_D, eps)


@_rms_norm_backward_op.register_fake
def _(grad_TD, x_TD, weight_D, eps):
    return x_TD.new_empty(x_TD.shape, dtype=torch.float32), weight_D.new_empty(weight_D.shape, dtype=torch.float32)


def _setup_plain(ctx, inputs, output):
    x_TD, weight_D, eps = inputs
    ctx.save_for_backward(x_TD, weight_D)
    ctx.eps = eps


def _backward_plain(ctx, grad_TD):
    x_TD, weight_D = ctx.saved_tensors
    grad_x, grad_weight = _rms_norm_backward_op(grad_TD.contiguous(), x_TD, weight_D, ctx.eps)
    return grad_x.to(x_TD.dtype), grad_weight.to(weight_D.dtype), None


def _setup_fused(ctx, inputs, output):
    x_TD, residual_TD, weight_D, eps = inputs
    ctx.save_for_backward(output[1], weight_D)
    ctx.eps = eps
    ctx.dtypes = (x_TD.dtype, residual_TD.dtype)


def _backward_fused(ctx, grad_y_TD, grad_residual_TD):
    new_residual_TD, weight_D = ctx.saved_tensors
    if grad_y_TD is None:
        grad_y_TD = torch.zeros_like(new_residual_TD)
    grad_x, grad_weight = _rms_norm_backward_op(grad_y_TD.contiguous(), new_residual_TD, weight_D, ctx.eps)
    if grad_residual_TD is not None:
        grad_x = grad_x + grad_residual_TD.float()
    return grad_x.to(ctx.dtypes[0]), grad_x.to(ctx.dtypes[1]), grad_weight.to(weight_D.dtype), None


torch.library.register_autograd("mok::rms_norm", _backward_plain, setup_context=_setup_plain)
torch.library.register_autograd("mok::fused_add_rms_norm", _backward_fused, setup_context=_setup_fused)


def rms_norm(
    x_TD: torch.Tensor,
    weight_D: torch.Tensor,
    eps: float,
    residual_TD: torch.Tensor | None = None,
    *,
    name: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Batch-invariant RMSNorm over the last dim.

    x_TD: [..., D] float (fp32/bf16/fp16); weight_D: [D]; eps: float; residual_TD: None or like x.
    Returns y [..., D] in x's dtype, or with a residual (y, new_residual), new_residual = x + residual
    rounded to x's dtype and y = rms_norm(new_residual). Differentiable (deterministic backward).
    `name`: when set and observed, emits (name, normalized row, "input") and (name, y, "output"); the
    normalized row is x, or the new residual when a residual is given: the row that alone determines y,
    so verify can align the op by content.
    """
    if x_TD.dtype not in FLOAT_DTYPES or weight_D.dtype not in FLOAT_DTYPES:
        raise UnsupportedError(f"rms_norm: dtypes {x_TD.dtype}/{weight_D.dtype} not in {FLOAT_DTYPES}")
    if tuple(weight_D.shape) != (x_TD.shape[-1],):
        raise UnsupportedError(f"rms_norm: weight {tuple(weight_D.shape)} must be [{x_TD.shape[-1]}] for x {tuple(x_TD.shape)}")
    if residual_TD is not None and residual_TD.shape != x_TD.shape:
        raise UnsupportedError(f"rms_norm: residual {tuple(residual_TD.shape)} must match x {tuple(x_TD.shape)}")
    observed = name is not None and hooks.observed()
    shape = x_TD.shape
    x_flat = x_TD.reshape(-1, shape[-1])
    eps = float(eps)
    if residual_TD is None:
        y_TD = _rms_norm_op(x_flat, weight_D, eps).reshape(shape)
        result = y_TD
    else:
        y_flat, new_residual_flat = _fused_add_rms_norm_op(x_flat, residual_TD.reshape(-1, shape[-1]), weight_D, eps)
        y_TD = y_flat.reshape(shape)
        result = (y_TD, new_residual_flat.reshape(shape))
    if observed:
        hooks.emit(name, x_TD if residual_TD is None else result[1], "input")
        hooks.emit(name, y_TD, "output")
    return result
