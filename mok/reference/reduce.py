"""Sequential, batch-invariant reductions for the CPU reference paths (see mok/reference/__init__.py).

Legend: M rows (tokens), N output columns, K reduction length.
"""
from __future__ import annotations

import torch


def matmul_nt(x_MK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """out[m, n] = sum_k x[m, k] * w[n, k], accumulated in fp32 over k = 0, 1, ..., K-1 in order.

    x_MK: [M, K], w_NK: [N, K], any float dtype (bf16 products are exact in fp32).
    Returns fp32 [M, N]. Row m's bits depend only on x[m] and w: the order over k is fixed and every
    step is an element-wise multiply followed by an element-wise add.
    """
    if x_MK.dim() != 2 or w_NK.dim() != 2 or x_MK.shape[1] != w_NK.shape[1]:
        raise ValueError(f"matmul_nt: shapes {tuple(x_MK.shape)} and {tuple(w_NK.shape)} do not match [M, K] x [N, K]")
    x_KM = x_MK.float().t().contiguous()
    w_KN = w_NK.float().t().contiguous()
    acc_MN = torch.zeros(x_MK.shape[0], w_NK.shape[0], dtype=torch.float32, device=x_MK.device)
    for k in range(x_KM.shape[0]):
        acc_MN.add_(x_KM[k][:, None] * w_KN[k][None, :])
    return acc_MN


def sum_last(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension in fp32, sequentially in index order. [..., K] -> [...]."""
    x = x.float()
    acc = torch.zeros(x.shape[:-1], dtype=torch.float32, device=x.device)
    for k in range(x.shape[-1]):
        acc.add_(x[..., k])
    return acc
