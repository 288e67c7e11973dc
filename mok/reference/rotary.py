"""CPU reference of mok.rotary, and the rotary frequencies both paths share.

Shapes: docs/shapes.md (x_TQD: Q heads, query or key/value heads alike; R the rotary dim, <= D and
even; R / 2 frequencies).
Semantics: inv_freq[f] = 1 / theta ** (2f / R), computed in fp64 on the host and rounded once to fp32
(the same tensor on CPU and GPU); angle = fp32(position) * inv_freq (one fp32 rounding);
cos/sin of the fp32 angle rounded to fp32; rotation in fp32 (products, then sum), one rounding.
neox style rotates the halves (x[:R/2], x[R/2:R]); GPT-J style the interleaved pairs (x[2f], x[2f+1]).
Dims past R pass through unchanged. The backward is the rotation by -angle (inverse=True).
YaRN (`YarnScaling`, DeepSeek-V3's rope_type 'yarn'): inv_freq blends 1 / theta ** (2f / R) (extrapolation) and
that divided by `factor` (interpolation) by a linear ramp over f between the correction dims of beta_fast and
beta_slow (floored / ceiled and clamped to [0, R - 1], transformers' and vLLM's formula), all in fp64 on the host,
rounded once to fp32; cos and sin are then multiplied by the fp32 `attention_factor` (one more fp32 rounding,
exact for 1.0).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from mok.reference import elementwise


class YarnScaling(NamedTuple):
    """YaRN rope scaling (rope_type 'yarn' with transformers' truncate=True): the fields of rope_parameters."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0  # cos and sin are multiplied by it (DeepSeek-V3: mscale / mscale_all_dim)


def _yarn_ramp(theta: float, rotary_dim: int, yarn: YarnScaling) -> list[float]:
    """The extrapolation weight of each of the R / 2 frequencies (1: unscaled, 0: divided by factor), fp64."""
    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), rotary_dim - 1)
    if low == high:
        high += 0.001  # transformers' and vLLM's guard against a zero-width ramp
    return [1.0 - min(max((f - low) / (high - low), 0.0), 1.0) for f in range(rotary_dim // 2)]


@functools.lru_cache(maxsize=64)
def _inv_freq_cpu(theta: float, rotary_dim: int, yarn: YarnScaling | None = None) -> torch.Tensor:
    values = [1.0 / (theta ** (i / rotary_dim)) for i in range(0, rotary_dim, 2)]
    if yarn is not None:
        values = [v / yarn.factor * (1.0 - w) + v * w for v, w in zip(values, _yarn_ramp(theta, rotary_dim, yarn))]
    return torch.tensor(values, dtype=torch.float64).float()


def inv_freq(theta: float, rotary_dim: int, yarn: YarnScaling | None = None) -> torch.Tensor:
    """fp32 [R / 2] on the CPU: Python (fp64) pow (and YaRN's blend), rounded once."""
    return _inv_freq_cpu(float(theta), int(rotary_dim), yarn)


def yarn_from_list(values: list[float] | None) -> YarnScaling | None:
    """The custom op's `yarn` argument (None or an empty list: none) as a YarnScaling."""
    if not values:
        return None
    factor, original, beta_fast, beta_slow, attention_factor = values
    return YarnScaling(factor, int(original), beta_fast, beta_slow, attention_factor)


def cos_sin(positions_T: torch.Tensor, theta: float, rotary_dim: int, yarn: YarnScaling | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos, sin [T, R / 2] of angle = fp32(position) * inv_freq, position-independent per element."""
    angle = positions_T.float()[:, None] * inv_freq(theta, rotary_dim, yarn)[None, :]  # [T, R / 2]
    cos, sin = elementwise.cos(angle), elementwise.sin(angle)
    if yarn is not None and yarn.attention_factor != 1.0:
        scale = torch.tensor(yarn.attention_factor, dtype=torch.float32)
        cos, sin = cos * scale, sin * scale
    return cos, sin


def rotary(
    x_TQD: torch.Tensor,
    positions_T: torch.Tensor,
    theta: float,
    rotary_dim: int,
    neox_style: bool,
    inverse: bool = False,
    yarn: YarnScaling | None = None,
) -> torch.Tensor:
    """[T, Q, D] -> [T, Q, D] in x's dtype; inverse=True rotates by -angle (the backward: with YaRN's
    attention_factor a the backward of x -> a R x is a R^T, the same op by -angle)."""
    half = rotary_dim // 2
    cos, sin = cos_sin(positions_T, theta, rotary_dim, yarn)  # [T, R / 2]
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
