"""mok.linear: batch-invariant x @ W.T (+ b), Triton on CUDA, sequential-K reference on CPU.

Legend: T tokens (leading dims flattened), K input features, N output features, B batch of matmuls.
Forward: fp32 accumulation over K in one unsplit sequential loop, bias added in fp32, one rounding to
x's dtype. The tile configuration depends on (N, K) only, never on T.
Backward (deterministic, not batch-invariant): dX = dY @ W and dW = dY.T @ X use the same kind of
sequential-K matmul (for dW the K loop runs over tokens in order); db sums tokens in order.
"""
from __future__ import annotations

import torch

from mok import hooks
from mok.errors import UnsupportedError

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_device(*tensors: torch.Tensor) -> str:
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise UnsupportedError(f"all inputs must be on one device, got {device} and {t.device}")
    if device.type not in ("cpu", "cuda"):
        raise UnsupportedError(f"mok ops run on cpu or cuda tensors, not {device.type}")
    return device.type


def matmul_nt_f32(a_BMK: torch.Tensor, b_BNK: torch.Tensor) -> torch.Tensor:
    """Deterministic batched a @ b.T: [B, M, K] x [B, N, K] -> fp32 [B, M, N], sequential K loop.

    Any strides. CPU: element-wise loop (mok.reference.linear.bmm_nt); CUDA: the Triton matmul.
    """
    if _check_device(a_BMK, b_BNK) == "cuda":
        from mok.kernels import linear as kernels

        return kernels.matmul(a_BMK, b_BNK.transpose(-1, -2), out_dtype=torch.float32)
    from mok.reference import linear as reference

    return reference.bmm_nt(a_BMK, b_BNK)


def sum_rows_f32(x_MN: torch.Tensor) -> torch.Tensor:
    """Deterministic sum over the first dim: [M, N] -> fp32 [N] (CPU: rows in order; CUDA: torch.sum,
    whose reduction order is fixed for a given shape)."""
    if x_MN.device.type == "cuda":
        return x_MN.float().sum(0)
    from mok.reference import linear as reference

    return reference.sum_rows(x_MN)


@torch.library.custom_op("mok::linear", mutates_args=())
def _linear_op(x_TK: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor | None) -> torch.Tensor:
    if _check_device(x_TK, weight_NK) == "cuda":
        from mok.kernels import linear as kernels

        return kernels.linear(x_TK, weight_NK, bias_N)
    from mok.reference import linear as reference

    return reference.linear(x_TK, weight_NK, bias_N)


@_linear_op.register_fake
def _(x_TK, weight_NK, bias_N):
    return x_TK.new_empty(x_TK.shape[0], weight_NK.shape[0])


@torch.library.custom_op("mok::linear_backward", mutates_args=())
def _linear_backward_op(
    grad_TN: torch.Tensor, x_TK: torch.Tensor, weight_NK: torch.Tensor, has_bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grad_x_TK = matmul_nt_f32(grad_TN[None], weight_NK.t()[None])[0].to(x_TK.dtype)
    grad_weight_NK = matmul_nt_f32(grad_TN.t()[None], x_TK.t()[None])[0].to(weight_NK.dtype)
    if has_bias:
        grad_bias_N = sum_rows_f32(grad_TN)
    else:
        grad_bias_N = grad_TN.new_empty(0, dtype=torch.float32)
    return grad_x_TK, grad_weight_NK, grad_bias_N


@_linear_backward_op.register_fake
def _(grad_TN, x_TK, weight_NK, has_bias):
    n_bias = weight_NK.shape[0] if has_bias else 0
    return torch.empty_like(x_TK), torch.empty_like(weight_NK), grad_TN.new_empty(n_bias, dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    x_TK, weight_NK, bias_N = inputs
    ctx.save_for_backward(x_TK, weight_NK)
    ctx.bias_dtype = None if bias_N is None else bias_N.dtype


def _backward(ctx, grad_TN):
    x_TK, weight_NK = ctx.saved_tensors
    has_bias = ctx.bias_dtype is not None
    grad_x, grad_weight, grad_bias = _linear_backward_op(grad_TN.contiguous(), x_TK, weight_NK, has_bias)
    return grad_x, grad_weight, (grad_bias.to(ctx.bias_dtype) if has_bias else None)


torch.library.register_autograd("mok::linear", _backward, setup_context=_setup_context)


def linear(
    x_TK: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor | None = None, *, name: str | None = None
) -> torch.Tensor:
    """Batch-invariant `x @ weight.T + bias`.

    x_TK: [..., K] float (fp32/bf16/fp16); weight_NK: [N, K]; bias_N: [N] or None.
    Returns [..., N] in x's dtype: fp32 accumulation in a fixed sequential K order, one rounding.
    A row's bits depend only on that row and the weights. Differentiable (deterministic backward).
    `name`: when set and mok.hooks is observed, emits (name, x, "input") and (name, out, "output").
    """
    if x_TK.dtype not in FLOAT_DTYPES or weight_NK.dtype not in FLOAT_DTYPES:
        raise UnsupportedError(f"linear: dtypes {x_TK.dtype}/{weight_NK.dtype} not in {FLOAT_DTYPES}")
    if weight_NK.dim() != 2 or x_TK.shape[-1] != weight_NK.shape[1]:
        raise UnsupportedError(f"linear: x {tuple(x_TK.shape)} does not match weight {tuple(weight_NK.shape)} ([..., K] x [N, K])")
    if bias_N is not None and tuple(bias_N.shape) != (weight_NK.shape[0],):
        raise UnsupportedError(f"linear: bias {tuple(bias_N.shape)} must be [{weight_NK.shape[0]}]")
    observed = name is not None and hooks.observed()
    if observed:
        hooks.emit(name, x_TK, "input")
    lead = x_TK.shape[:-1]
    out_TN = _linear_op(x_TK.reshape(-1, x_TK.shape[-1]), weight_NK, bias_N).reshape(*lead, weight_NK.shape[0])
    if observed:
        hooks.emit(name, out_TN, "output")
    return out_TN
