"""Padded [B, L] batches <-> packed token streams (padding removed) for the varlen ops.

A row's real tokens are those with attention_mask 1; they must be contiguous (left or right padding,
or none). Token positions count from 0 at a row's first real token, whatever the padding side (so
left padding gives the same numbers as right padding, unlike transformers' default position_ids).

Shapes: docs/shapes.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rl.errors import InputError


@dataclass(frozen=True)
class Packed:
    input_ids_T: torch.Tensor  # int64 [T]
    positions_T: torch.Tensor  # int64 [T]
    cu_seqlens: torch.Tensor  # int32 [B'+1] over the non-empty rows
    real_BL: torch.Tensor  # bool [B, L]: True where a real token sits (row-major order = packed order)
    has_next_T: torch.Tensor  # bool [T]: the token has a successor in its row


def pack(input_ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor | None = None) -> Packed:
    """Pack the real tokens of a padded batch.

    input_ids_BL: [B, L] integer; attention_mask_BL: [B, L] of 0/1 (bool or integer) or None (all real).
    Raises rl.InputError for other shapes or a row whose real tokens are not contiguous. B = 0 or L = 0
    or an all-padding batch give an empty packed stream (T = 0).
    """
    if input_ids_BL.dim() != 2 or input_ids_BL.dtype.is_floating_point or input_ids_BL.dtype == torch.bool:
        raise InputError(f"input_ids must be an integer tensor [batch, seq], got {input_ids_BL.dtype} "
                               f"{tuple(input_ids_BL.shape)}")
    if attention_mask_BL is None:
        real_BL = torch.ones(input_ids_BL.shape, dtype=torch.bool, device=input_ids_BL.device)
    else:
        if attention_mask_BL.shape != input_ids_BL.shape:
            raise InputError(f"attention_mask {tuple(attention_mask_BL.shape)} must match input_ids "
                                   f"{tuple(input_ids_BL.shape)}")
        real_BL = attention_mask_BL.to(device=input_ids_BL.device) != 0
    real_i_BL = real_BL.to(torch.int64)
    # A contiguous run of real tokens has at most one 0->1 step counting an implicit 0 before the row.
    starts_B = (torch.diff(real_i_BL, dim=1, prepend=torch.zeros_like(real_i_BL[:, :1])) == 1).sum(1)
    if bool((starts_B > 1).any()):
        row = int(torch.nonzero(starts_B > 1)[0, 0])
        raise InputError(f"attention_mask row {row} has gaps: real tokens must be contiguous "
                               "(left or right padding)")
    lengths_B = real_i_BL.sum(1)
    positions_BL = torch.cumsum(real_i_BL, dim=1) - 1
    lengths_nonempty = lengths_B[lengths_B > 0]
    cu_seqlens = torch.zeros(lengths_nonempty.numel() + 1, dtype=torch.int32, device=input_ids_BL.device)
    cu_seqlens[1:] = torch.cumsum(lengths_nonempty, 0).to(torch.int32)
    has_next_BL = real_BL.clone()
    if has_next_BL.shape[1]:
        has_next_BL[:, :-1] &= real_BL[:, 1:]
        has_next_BL[:, -1] = False
    return Packed(
        input_ids_T=input_ids_BL[real_BL].to(torch.int64),
        positions_T=positions_BL[real_BL],
        cu_seqlens=cu_seqlens,
        real_BL=real_BL,
        has_next_T=has_next_BL[real_BL],
    )


def unpack(values_T: torch.Tensor, real_BL: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Scatter packed rows [T, ...] back to [B, L, ...], `fill` at padding. Differentiable."""
    out = values_T.new_full((*real_BL.shape, *values_T.shape[1:]), fill)
    return out.index_put((real_BL,), values_T)


def check_has_data(tensor, label: str) -> None:
    """A tensor argument must hold readable values: dense (strided), not on the meta device. (Other types,
    shapes and dtypes are checked where the batch is packed.)"""
    if not isinstance(tensor, torch.Tensor):
        return
    if tensor.is_meta:
        raise InputError(f"{label} is on the meta device (it holds no values); pass it on the CPU or the model's "
                         "device")
    if tensor.is_nested or tensor.layout != torch.strided:
        raise InputError(f"{label} must be a dense tensor, got layout {tensor.layout} (convert with .to_dense())")
