"""CPU reference of mok.linear and the deterministic matmuls its backward (and attention's) uses.

Legend: M rows (tokens), N output features, K reduction length, B batch of independent matmuls.
Every reduction is a sequential loop of element-wise multiply then add in fp32 (see
mok/reference/__init__.py), so a row's bits depend only on that row and the weights.
"""
from __future__ import annotations

import torch

from mok.reference.reduce import matmul_nt


def linear(x_MK: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T (+ bias): fp32 accumulation over k = 0..K-1 in order, bias added in fp32, one rounding.

    x_MK: [M, K], weight_NK: [N, K], bias_N: [N] or None; any float dtypes. Returns [M, N] in x's dtype.
    """
    acc_MN = matmul_nt(x_MK, weight_NK)
    if bias_N is not None:
        acc_MN = acc_MN + bias_N.float()
    return acc_MN.to(x_MK.dtype)


def bmm_nt(a_BMK: torch.Tensor, b_BNK: torch.Tensor) -> torch.Tensor:
    """Batched out[b, m, n] = sum_k a[b, m, k] * b[b, n, k], fp32, sequential over k. Returns fp32 [B, M, N]."""
    a_KBM = a_BMK.float().permute(2, 0, 1).contiguous()
    b_KBN = b_BNK.float().permute(2, 0, 1).contiguous()
    acc_BMN = torch.zeros(a_BMK.shape[0], a_BMK.shape[1], b_BNK.shape[1], dtype=torch.float32)
    for k in range(a_KBM.shape[0]):
        acc_BMN.add_(a_KBM[k][:, :, None] * b_KBN[k][:, None, :])
    return acc_BMN


def sum_rows(x_MN: torch.Tensor) -> torch.Tensor:
    """Sum over the first dimension in fp32, rows 0, 1, ..., M-1 in order. [M, N] -> fp32 [N]."""
    x_MN = x_MN.float()
    acc_N = torch.zeros(x_MN.shape[1:], dtype=torch.float32)
    for m in range(x_MN.shape[0]):
        acc_N.add_(x_MN[m])
    return acc_N
