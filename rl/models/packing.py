"""Padded [B, S] batches <-> packed token streams (padding removed) for the varlen ops.

A row's real tokens are those with attention_mask 1; they must be contiguous (left or right padding,
or none). Token positions count from 0 at a row's first real token, whatever the padding side (so
left padding gives the same numbers as right padding, unlike transformers' default position_ids).

Legend: B rows, S padded length, T packed real tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mok.errors import UnsupportedError


@dataclass(frozen=True)
class Packed:
    input_ids_T: torch.Tensor  # int64 [T]
    positions_T: torch.Tensor  # int64 [T]
    cu_seqlens: torch.Tensor  # int32 [B'+1] over the non-empty rows
    real_BS: torch.Tensor  # bool [B, S]: True where a real token sits (row-major order = packed order)
    has_next_T: torch.Tensor  # bool [T]: the token has a successor in its row


def pack(input_ids_BS: torch.Tensor, attention_mask_BS: torch.Tensor | None = None) -> Packed:
    """Pack the real tokens of a padded batch.

    input_ids_BS: [B, S] integer; attention_mask_BS: [B, S] of 0/1 (bool or integer) or None (all real).
    Raises UnsupportedError for other shapes or a row whose real tokens are not contiguous.
    """
    if input_ids_BS.dim() != 2 or input_ids_BS.dtype.is_floating_point or input_ids_BS.dtype == torch.bool:
        raise UnsupportedError(f"input_ids must be an integer tensor [batch, seq], got {input_ids_BS.dtype} "
                               f"{tuple(input_ids_BS.shape)}")
    if attention_mask_BS is None:
        real_BS = torch.ones(input_ids_BS.shape, dtype=torch.bool, device=input_ids_BS.device)
    else:
        if attention_mask_BS.shape != input_ids_BS.shape:
            raise UnsupportedError(f"attention_mask {tuple(attention_mask_BS.shape)} must match input_ids "
                                   f"{tuple(input_ids_BS.shape)}")
        real_BS = attention_mask_BS.to(device=input_ids_BS.device) != 0
    real_i_BS = real_BS.to(torch.int64)
    # A contiguous run of real tokens has at most one 0->1 step counting an implicit 0 before the row.
    starts_B = (torch.diff(real_i_BS, dim=1, prepend=torch.zeros_like(real_i_BS[:, :1])) == 1).sum(1)
    if bool((starts_B > 1).any()):
        row = int(torch.nonzero(starts_B > 1)[0, 0])
        raise UnsupportedError(f"attention_mask row {row} has gaps: real tokens must be contiguous "
                               "(left or right padding)")
    lengths_B = real_i_BS.sum(1)
    positions_BS = torch.cumsum(real_i_BS, dim=1) - 1
    lengths_nonempty = lengths_B[lengths_B > 0]
    cu_seqlens = torch.zeros(lengths_nonempty.numel() + 1, dtype=torch.int32, device=input_ids_BS.device)
    cu_seqlens[1:] = torch.cumsum(lengths_nonempty, 0).to(torch.int32)
    has_next_BS = real_BS.clone()
    has_next_BS[:, :-1] &= real_BS[:, 1:]
    has_next_BS[:, -1] = False
    return Packed(
        input_ids_T=input_ids_BS[real_BS].to(torch.int64),
        positions_T=positions_BS[real_BS],
        cu_seqlens=cu_seqlens,
        real_BS=real_BS,
        has_next_T=has_next_BS[real_BS],
    )


def unpack(values_T: torch.Tensor, real_BS: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Scatter packed rows [T, ...] back to [B, S, ...], `fill` at padding. Differentiable."""
    out = values_T.new_full((*real_BS.shape, *values_T.shape[1:]), fill)
    return out.index_put((real_BS,), values_T)
