"""CPU reference of mok.rotary, and the rotary frequencies both paths share.

Legend: T tokens, H heads, D head dim, R rotary dim (<= D, even), F = R / 2 frequencies.
Semantics: inv_freq[f] = 1 / theta ** (2f / R), computed in fp64 on the host and rounded once to fp32
(the same tensor on CPU and GPU); angle = fp32(position) * inv_freq (one fp32 rounding);
cos/sin of the fp32 angle rounded to fp32; rotation in fp32 (products, then sum), one rounding.
neox style rotates the halves (x[:F], x[F:R]); GPT-J style the interleaved pairs (x[2f], x[2f+1]).
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
    angle_TF = positions_T.float()[:, None] * inv_freq(theta, rotary_dim)[None, :]
    return elementwise.cos(angle_TF), elementwise.sin(angle_TF)


def rotary(
    x_THD: torch.Tensor,
    positions_T: torch.Tensor,
    theta: float,
    rotary_dim: int,
    neox_style: bool,
    inverse: bool = False,
) -> torch.Tensor:
    """[T, H, D] -> [T, H, D] in x's dtype; inverse=True rotates by -angle (the backward)."""
    half = rotary_dim // 2
    cos_TF, sin_TF = cos_sin(positions_T, theta, rotary_dim)
    if inverse:
        sin_TF = -sin_TF
    cos_T1F, sin_T1F = cos_TF[:, None, :], sin_TF[:, None, :]
    x_f32 = x_THD.float()
    if neox_style:
        x1, x2 = x_f32[..., :half], x_f32[..., half:rotary_dim]
    else:
        x1, x2 = x_f32[..., 0:rotary_dim:2], x_f32[..., 1:rotary_dim:2]
    out1 = x1 * cos_T1F - x2 * sin_T1F
    out2 = x2 * cos_T1F + x1 * sin_T1F
    out = x_f32.clone()
    if neox_style:
        out[..., :half] = out1
        out[..., half:rotary_dim] = out2
    else:
        out[..., 0:rotary_dim:2] = out1
        out[..., 1:rotary_dim:2] = out2
    return out.to(x_THD.dtype)
