"""Operand layouts the Triton launchers share."""
from __future__ import annotations

import torch


def last_dim_contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    """t itself when its last dim has stride 1 (rows may be strided), else a contiguous copy; None stays None.
    The kernels address columns as `offs` (int32, stride 1): no column stride, no int32 overflow of offs * stride."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()
