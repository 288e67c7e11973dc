"""mok.linear: batch-invariant x @ W.T (+ b), Triton on CUDA, sequential-F reference on CPU.

Shapes: docs/shapes.md (x_TF: leading dims flattened into T; w_OF; out_TO).
Forward: fp32 accumulation over F in one unsplit sequential loop, bias added in fp32, one rounding to
x's dtype. The tile configuration depends on (O, F) only, never on T.
Backward (deterministic, not batch-invariant): dX = dY @ W and dW = dY.T @ X use the same kind of
sequential-reduction matmul (for dW the loop runs over tokens in order); db sums tokens in order.
Each op's default implementation is the CPU reference (mok/reference/linear.py); the CUDA kernel is
registered with register_kernel("cuda") (mok/kernels/linear.py). A plain eager CUDA call runs the native eager path
(mok/kernels/native): the same launches, forward, backward and autograd node in C++.
"""
from __future__ import annotations

import math

import torch

from mok import hooks
from mok.errors import UnsupportedError
from mok.ops import dispatch
from mok.ops.checks import FLOAT_DTYPES, check_device, check_name, check_tensor
from mok.reference import linear as reference


@torch.library.custom_op("mok::linear", mutates_args=())
def _linear_op(x_TF: torch.Tensor, w_OF: torch.Tensor, bias_O: torch.Tensor | None) -> torch.Tensor:
    check_device(x_TF, w_OF)
    return reference.linear(x_TF, w_OF, bias_O)


def _linear_cuda(x_TF, w_OF, bias_O):
    check_device(x_TF, w_OF)
    from mok.kernels import linear as kernels

    return kernels.linear(x_TF, w_OF, bias_O)


@_linear_op.register_fake
def _(x_TF, w_OF, bias_O):
    return x_TF.new_empty(x_TF.shape[0], w_OF.shape[0])


def _linear_backward(grad_TO, x_TF, w_OF, has_bias, bmm_nt, sum_rows):
    """(d x [T, F] in x's dtype, d w [O, F] in w's dtype, d bias fp32 [O] or [0]) from the device's
    sequential-reduction bmm_nt ([B, T, F] x [B, O, F] -> [B, T, O] in out_dtype, rounded once from fp32:
    the bits of an fp32 result cast afterwards, without its round trip) and fp32 row sum."""
    grad_x_TF = bmm_nt(grad_TO[None], w_OF.t()[None], x_TF.dtype)[0]
    grad_w_OF = bmm_nt(grad_TO.t()[None], x_TF.t()[None], w_OF.dtype)[0]
    if has_bias:
        grad_bias_O = sum_rows(grad_TO)
    else:
        grad_bias_O = grad_TO.new_empty(0, dtype=torch.float32)
    return grad_x_TF, grad_w_OF, grad_bias_O


@torch.library.custom_op("mok::linear_backward", mutates_args=())
def _linear_backward_op(
    grad_TO: torch.Tensor, x_TF: torch.Tensor, w_OF: torch.Tensor, has_bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _linear_backward(grad_TO, x_TF, w_OF, has_bias, reference.bmm_nt, reference.sum_rows)


def _linear_backward_cuda(grad_TO, x_TF, w_OF, has_bias):
    from mok.kernels import linear as kernels

    # torch.sum over rows: its reduction order is fixed for a given shape
    return _linear_backward(grad_TO, x_TF, w_OF, has_bias, kernels.bmm_nt, lambda g_TO: g_TO.float().sum(0))


@_linear_backward_op.register_fake
def _(grad_TO, x_TF, w_OF, has_bias):
    n_bias = w_OF.shape[0] if has_bias else 0
    return torch.empty_like(x_TF), torch.empty_like(w_OF), grad_TO.new_empty(n_bias, dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    x_TF, w_OF, bias_O = inputs
    ctx.save_for_backward(x_TF, w_OF)
    ctx.bias_dtype = None if bias_O is None else bias_O.dtype


def _backward(ctx, grad_TO):
    x_TF, w_OF = ctx.saved_tensors
    has_bias = ctx.bias_dtype is not None
    grad_x_TF, grad_w_OF, grad_bias_O = _linear_backward_eager(grad_TO.contiguous(), x_TF, w_OF, has_bias)
    return grad_x_TF, grad_w_OF, (grad_bias_O.to(ctx.bias_dtype) if has_bias else None)


_linear = dispatch.register(_linear_op, cuda=_linear_cuda, backward=_backward, setup_context=_setup_context,
                           native="linear")
_linear_backward_eager = dispatch.register(_linear_backward_op, cuda=_linear_backward_cuda)


def linear(
    x_TF: torch.Tensor, weight_OF: torch.Tensor, bias_O: torch.Tensor | None = None, *, name: str | None = None
) -> torch.Tensor:
    """Batch-invariant `x @ weight.T + bias`.

    x_TF: [..., F] float (fp32/bf16/fp16); weight_OF: [O, F]; bias_O: [O] or None (docs/shapes.md).
    Returns [..., O] in x's dtype: fp32 accumulation in a fixed sequential F order, one rounding.
    A row's bits depend only on that row and the weights. Differentiable (deterministic backward).
    `name`: when set and mok.hooks is observed, emits (name, x, "input") and (name, out, "output").
    """
    check_name(name, "linear")
    if name is None or not hooks.observed():
        out_TO = dispatch.native_call("linear_call", x_TF, weight_OF, bias_O)
        if out_TO is not None:
            return out_TO
    check_tensor(x_TF, "linear: x")
    check_tensor(weight_OF, "linear: weight")
    if bias_O is not None:
        check_tensor(bias_O, "linear: bias")
    if x_TF.dtype not in FLOAT_DTYPES or weight_OF.dtype not in FLOAT_DTYPES:
        raise UnsupportedError(f"linear: dtypes {x_TF.dtype}/{weight_OF.dtype} not in {FLOAT_DTYPES}")
    if x_TF.dim() < 1 or weight_OF.dim() != 2 or x_TF.shape[-1] != weight_OF.shape[1]:
        raise UnsupportedError(
            f"linear: x {tuple(x_TF.shape)} does not match weight {tuple(weight_OF.shape)} ([..., F] x [O, F])")
    if bias_O is not None and tuple(bias_O.shape) != (weight_OF.shape[0],):
        raise UnsupportedError(f"linear: bias {tuple(bias_O.shape)} must be [{weight_OF.shape[0]}]")
    if bias_O is not None and bias_O.dtype not in FLOAT_DTYPES:
        raise UnsupportedError(f"linear: bias dtype {bias_O.dtype} not in {FLOAT_DTYPES}")
    check_device(x_TF, weight_OF, *(() if bias_O is None else (bias_O,)))
    observed = name is not None and hooks.observed()
    if observed:
        hooks.emit(name, x_TF, "input")
    out_TO = dispatch.shaped(_linear(dispatch.rows(x_TF), weight_OF, bias_O), (*x_TF.shape[:-1], weight_OF.shape[0]))
    if observed:
        hooks.emit(name, out_TO, "output")
    return out_TO


@torch.library.custom_op("mok::head_linear", mutates_args=())
def _head_linear_op(x_TQF: torch.Tensor, w_QOF: torch.Tensor) -> torch.Tensor:
    check_device(x_TQF, w_QOF)
    return reference.head_linear(x_TQF, w_QOF)


def _head_linear_cuda(x_TQF, w_QOF):
    check_device(x_TQF, w_QOF)
    from mok.kernels import linear as kernels

    return kernels.head_linear(x_TQF, w_QOF)


@_head_linear_op.register_fake
def _(x_TQF, w_QOF):
    return x_TQF.new_empty(x_TQF.shape[0], x_TQF.shape[1], w_QOF.shape[1])


@torch.library.custom_op("mok::head_linear_backward", mutates_args=())
def _head_linear_backward_op(grad_TQO: torch.Tensor, x_TQF: torch.Tensor, w_QOF: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    return reference.head_linear_backward(grad_TQO, x_TQF, w_QOF)


def _head_linear_backward_cuda(grad_TQO, x_TQF, w_QOF):
    from mok.kernels import linear as kernels

    return kernels.head_linear_backward(grad_TQO, x_TQF, w_QOF)


@_head_linear_backward_op.register_fake
def _(grad_TQO, x_TQF, w_QOF):
    return (torch.empty_like(x_TQF, memory_format=torch.contiguous_format),
            torch.empty_like(w_QOF, memory_format=torch.contiguous_format))


def _head_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _head_backward(ctx, grad_TQO):
    return _head_linear_backward_eager(grad_TQO, *ctx.saved_tensors)


_head_linear_backward_eager = dispatch.register(_head_linear_backward_op, cuda=_head_linear_backward_cuda)
_head_linear = dispatch.register(_head_linear_op, cuda=_head_linear_cuda, backward=_head_backward,
                                 setup_context=_head_setup_context)


def head_linear(x_TQF: torch.Tensor, weight_QOF: torch.Tensor, *, name: str | None = None) -> torch.Tensor:
    """Batch-invariant linears of Q heads at once: out[t, q] = x[t, q] @ weight[q].T, no bias.

    x_TQF: [..., Q, F] float (fp32/bf16/fp16); weight_QOF: [Q, O, F], read through its strides (a view of a
    bigger weight is fine). Returns [..., Q, O] in x's dtype. Head q's rows have exactly the bits of
    `mok.linear(x[..., q, :], weight[q])`, and so do the gradients (one launch over the heads instead of Q:
    the weight-absorbed MLA of rl/models/mla.py). Differentiable (deterministic backward).
    `name`: when set and mok.hooks is observed, emits (name, x, "input") and (name, out, "output").

    >>> import torch, mok
    >>> x, w = torch.randn(3, 4, 8), torch.randn(4, 5, 8)
    >>> out = mok.head_linear(x, w)
    >>> out.shape, torch.equal(out[:, 2], mok.linear(x[:, 2], w[2]))
    (torch.Size([3, 4, 5]), True)
    """
    check_name(name, "head_linear")
    check_tensor(x_TQF, "head_linear: x")
    check_tensor(weight_QOF, "head_linear: weight")
    if x_TQF.dtype not in FLOAT_DTYPES or weight_QOF.dtype not in FLOAT_DTYPES:
        raise UnsupportedError(f"head_linear: dtypes {x_TQF.dtype}/{weight_QOF.dtype} not in {FLOAT_DTYPES}")
    if x_TQF.dim() < 2 or weight_QOF.dim() != 3 or tuple(x_TQF.shape[-2:]) != (weight_QOF.shape[0],
                                                                                weight_QOF.shape[2]):
        raise UnsupportedError(f"head_linear: x {tuple(x_TQF.shape)} does not match weight "
                               f"{tuple(weight_QOF.shape)} ([..., Q, F] x [Q, O, F])")
    check_device(x_TQF, weight_QOF)
    observed = name is not None and hooks.observed()
    if observed:
        hooks.emit(name, x_TQF, "input")
    heads, width = x_TQF.shape[-2:]
    x_flat_TQF = x_TQF if x_TQF.dim() == 3 else x_TQF.reshape(math.prod(x_TQF.shape[:-2]), heads, width)
    out_TQO = dispatch.shaped(_head_linear(x_flat_TQF, weight_QOF), (*x_TQF.shape[:-1], weight_QOF.shape[1]))
    if observed:
        hooks.emit(name, out_TQO, "output")
    return out_TQO
