"""Bitwise equality for the tests: the product's promise is the same bits, so NaN payloads and the sign of
zero count (torch.equal calls NaN unequal to itself and -0.0 equal to +0.0)."""
from __future__ import annotations

import torch


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and every bit (NaN payloads and signed zeros included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))
