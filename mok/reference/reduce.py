"""Sequential, batch-invariant reductions for the CPU reference paths (see mok/reference/__init__.py).

Shapes: docs/shapes.md (a matmul's rows T, reduction F, output columns O, as in a linear).
"""
from __future__ import annotations

import torch


def matmul_nt(x_TF: torch.Tensor, w_OF: torch.Tensor) -> torch.Tensor:
    """out[t, o] = sum_f x[t, f] * w[o, f], accumulated in fp32 over f = 0, 1, ..., F-1 in order.

    x_TF: [T, F], w_OF: [O, F], any float dtype (bf16 products are exact in fp32).
    Returns fp32 [T, O]. Row t's bits depend only on x[t] and w: the order over f is fixed and every
    step is an element-wise multiply followed by an element-wise add.
    """
    if x_TF.dim() != 2 or w_OF.dim() != 2 or x_TF.shape[1] != w_OF.shape[1]:
        raise ValueError(f"matmul_nt: shapes {tuple(x_TF.shape)} and {tuple(w_OF.shape)} do not match [T, F] x [O, F]")
    x_FT = x_TF.float().t().contiguous()
    w_FO = w_OF.float().t().contiguous()
    acc_TO = torch.zeros(x_TF.shape[0], w_OF.shape[0], dtype=torch.float32, device=x_TF.device)
    for f in range(x_FT.shape[0]):
        acc_TO.add_(x_FT[f][:, None] * w_FO[f][None, :])
    return acc_TO


def sum_last(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension in fp32, sequentially in index order. [..., F] -> [...]."""
    x = x.float()
    acc = torch.zeros(x.shape[:-1], dtype=torch.float32, device=x.device)
    for f in range(x.shape[-1]):
        acc.add_(x[..., f])
    return acc
