"""CPU reference of mok.linear and the deterministic matmuls its backward (and attention's) uses.

Shapes: docs/shapes.md (a matmul's rows T, reduction F, output columns O, as in a linear; B a batch of
independent products). Every reduction is a sequential loop of element-wise multiply then add in fp32
(see mok/reference/__init__.py), so a row's bits depend only on that row and the weights.
"""
from __future__ import annotations

import torch

from mok.reference.reduce import matmul_nt


def linear(x_TF: torch.Tensor, w_OF: torch.Tensor, bias_O: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T (+ bias): fp32 accumulation over f = 0..F-1 in order, bias added in fp32, one rounding.

    x_TF: [T, F], w_OF: [O, F], bias_O: [O] or None; any float dtypes. Returns [T, O] in x's dtype.
    """
    acc_TO = matmul_nt(x_TF, w_OF)
    if bias_O is not None:
        acc_TO = acc_TO + bias_O.float()
    return acc_TO.to(x_TF.dtype)


def head_linear(x_TQF: torch.Tensor, w_QOF: torch.Tensor) -> torch.Tensor:
    """[T, Q, O]: per head q, linear(x[:, q], w[q], None): the bits of Q separate linears."""
    out_TQO = x_TQF.new_empty(x_TQF.shape[0], w_QOF.shape[0], w_QOF.shape[1])
    for q in range(w_QOF.shape[0]):
        out_TQO[:, q] = linear(x_TQF[:, q], w_QOF[q], None)
    return out_TQO


def head_linear_backward(grad_TQO: torch.Tensor, x_TQF: torch.Tensor, w_QOF: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(d x [T, Q, F] in x's dtype, d w [Q, O, F] in w's dtype): per head, linear's backward."""
    grad_x_QTF = bmm_nt(grad_TQO.transpose(0, 1), w_QOF.transpose(-1, -2), x_TQF.dtype)
    grad_w_QOF = bmm_nt(grad_TQO.permute(1, 2, 0), x_TQF.permute(1, 2, 0), w_QOF.dtype)
    return grad_x_QTF.transpose(0, 1).contiguous(), grad_w_QOF


def bmm_nt(a_BTF: torch.Tensor, b_BOF: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Batched out[b, t, o] = sum_f a[b, t, f] * b[b, o, f], fp32, sequential over f. Returns [B, T, O] in
    out_dtype (rounded once from fp32)."""
    a_FBT = a_BTF.float().permute(2, 0, 1).contiguous()
    b_FBO = b_BOF.float().permute(2, 0, 1).contiguous()
    acc_BTO = torch.zeros(a_BTF.shape[0], a_BTF.shape[1], b_BOF.shape[1], dtype=torch.float32)
    for f in range(a_FBT.shape[0]):
        acc_BTO.add_(a_FBT[f][:, :, None] * b_FBO[f][:, None, :])
    return acc_BTO.to(out_dtype)


def sum_rows(x_TO: torch.Tensor) -> torch.Tensor:
    """Sum over the first dimension in fp32, rows 0, 1, ..., T-1 in order. [T, O] -> fp32 [O]."""
    x_TO = x_TO.float()
    acc_O = torch.zeros(x_TO.shape[1:], dtype=torch.float32)
    for t in range(x_TO.shape[0]):
        acc_O.add_(x_TO[t])
    return acc_O
