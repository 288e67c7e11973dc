"""CPU reference of mok.rotary, and the rotary frequencies both paths share.

Shapes: docs/shapes.md (x_TQD: Q heads, query or key/value heads alike; R the rotary dim, <= D and
even; R / 2 frequencies).
Semantics: inv_freq[f] = 1 / theta ** (2f / R), computed in fp64 on the host and rounded once to fp32
(the same tensor on CPU and GPU); angle = fp32(position) * inv_freq (one fp32 rounding);
cos/sin of the fp32 angle rounded to fp32; rotation in fp32 (products, then sum), one rounding.
neox style rotates the halves (x[:R/2], x[R/2:R]); GPT-J style the interleaved pairs (x[2f], x[2f+1]).
Dims past R pass through unchanged. The backward is the rotation by -angle (inverse=True).
"""
from __future__ import annotations

import functools

import torch

from mok.reference import elementwise


@functools.lru_cache(maxsize=64)
def _inv_freq_cpu(theta: float, rotary_dim: int) -> torch.Tensor:
    values = [1.0 / (theta ** (i / rotary_dim)) for i in range(0, rotary_dim, 2)]
    return torch.tensor(values, dtype=torch.float64).float()


def inv_freq(theta: float, rotary_dim: int) -> torch.Tensor:
    """fp32 [R / 2] on the CPU: Python (fp64) pow, rounded once."""
    return _inv_freq_cpu(float(theta), int(rotary_dim))


def cos_sin(positions_T: torch.Tensor, theta: float, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos, sin [T, R / 2] of angle = fp32(position) * inv_freq, position-independent per element."""
    angle = positions_T.float()[:, None] * inv_freq(theta, rotary_dim)[None, :]  # [T, R / 2]
    return elementwise.cos(angle), elementwise.sin(angle)


def rotary(
    x_TQD: torch.Tensor,
    positions_T: torch.Tensor,
    theta: float,
    rotary_dim: int,
    neox_style: bool,
    inverse: bool = False,
) -> torch.Tensor:
    """[T, Q, D] -> [T, Q, D] in x's dtype; inverse=True rotates by -angle (the backward)."""
    half = rotary_dim // 2
    cos, sin = cos_sin(positions_T, theta, rotary_dim)  # [T, R / 2]
    if inverse:
        sin = -sin
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, R / 2]: the same for every head
    x_f32_TQD = x_TQD.float()
    if neox_style:
        x1, x2 = x_f32_TQD[..., :half], x_f32_TQD[..., half:rotary_dim]
    else:
        x1, x2 = x_f32_TQD[..., 0:rotary_dim:2], x_f32_TQD[..., 1:rotary_dim:2]
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
    out_TQD = x_f32_TQD.clone()
    if neox_style:
        out_TQD[..., :half] = out1
        out_TQD[..., half:rotary_dim] = out2
    else:
        out_TQD[..., 0:rotary_dim:2] = out1
        out_TQD[..., 1:rotary_dim:2] = out2
    return out_TQD.to(x_TQD.dtype)
