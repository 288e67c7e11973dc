"""Position-independent transcendental functions for the CPU reference paths.

torch.exp/log/sin/cos/sigmoid on the CPU run a vectorised kernel (Sleef, ~1 ulp) on most elements
and a scalar libm loop on the tail, so one element's bits can depend on where it sits in the tensor,
that is, on the batch. These versions use only IEEE basic operations (+, -, *, /, round, casts, bit
casts), which are exactly rounded per element on every code path, in fp64, and round once to fp32.
Every element therefore gets the same bits wherever it stands. Accuracy: within 1 ulp of fp32.

Inputs: any float tensor. Outputs: fp32 tensors of the same shape.
"""
from __future__ import annotations

import math

import torch

_LN2_HI = 6.93147180369123816490e-01  # fdlibm split of ln 2: n * _LN2_HI is exact for |n| < 2**20
_LN2_LO = 1.90821492927058770002e-10
_PIO2_1 = 1.57079632673412561417e00  # fdlibm three-part split of pi / 2 (Cody-Waite reduction)
_PIO2_2 = 6.07710050630396597660e-11
_PIO2_3 = 2.02226624871116645580e-21
_EXP_TAYLOR = [1.0 / math.factorial(i) for i in range(15)]
_SIN_TAYLOR = [(-1) ** i / math.factorial(2 * i + 1) for i in range(10)]
_COS_TAYLOR = [(-1) ** i / math.factorial(2 * i) for i in range(10)]


def _horner(z: torch.Tensor, coefficients: list[float]) -> torch.Tensor:
    acc = torch.full_like(z, coefficients[-1])
    for c in reversed(coefficients[:-1]):
        acc = acc * z + c
    return acc


def _pow2(n: torch.Tensor) -> torch.Tensor:
    """2**n for integer-valued fp64 n in the normal range, built from the exponent bits (exact)."""
    return ((n.to(torch.int64) + 1023) << 52).view(torch.float64)


def _exp64(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    # Far beyond fp32's range either way; clamping keeps 2**n a normal fp64 number.
    xc = x.clamp(-700.0, 700.0)
    n = torch.round(xc * (1.0 / math.log(2.0)))
    r = (xc - n * _LN2_HI) - n * _LN2_LO
    y = _horner(r, _EXP_TAYLOR) * _pow2(n)
    return torch.where(torch.isnan(x), x, y)


def exp(x: torch.Tensor) -> torch.Tensor:
    return _exp64(x).float()


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return (1.0 / (1.0 + _exp64(-x.double()))).float()


def silu(x: torch.Tensor) -> torch.Tensor:
    x64 = x.double()
    return (x64 / (1.0 + _exp64(-x64))).float()


def log(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    mantissa, exponent = torch.frexp(x.abs().clamp_min(torch.finfo(torch.float64).tiny))
    low = mantissa < math.sqrt(0.5)
    mantissa = torch.where(low, mantissa * 2.0, mantissa)
    e = exponent.double() - low.double()
    f = mantissa - 1.0
    s = f / (2.0 + f)  # log(1 + f) = 2 atanh(s), |s| <= 0.172
    s2 = s * s
    atanh_series = _horner(s2, [1.0 / (2 * i + 1) for i in range(14)])
    y = (e * _LN2_HI + (2.0 * s * atanh_series + e * _LN2_LO))
    y = torch.where(x == 0, torch.full_like(y, -math.inf), y)
    y = torch.where(x < 0, torch.full_like(y, math.nan), y)
    y = torch.where(torch.isinf(x) & (x > 0), x, y)
    return torch.where(torch.isnan(x), x, y).float()


def _reduce_quadrant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.double()
    n = torch.round(x * (2.0 / math.pi))
    r = ((x - n * _PIO2_1) - n * _PIO2_2) - n * _PIO2_3
    return r, n.to(torch.int64) & 3


def _sin_cos64(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r, quadrant = _reduce_quadrant(x)
    r2 = r * r
    s = r * _horner(r2, _SIN_TAYLOR)
    c = _horner(r2, _COS_TAYLOR)
    sin = torch.where(quadrant == 0, s, torch.where(quadrant == 1, c, torch.where(quadrant == 2, -s, -c)))
    cos = torch.where(quadrant == 0, c, torch.where(quadrant == 1, -s, torch.where(quadrant == 2, -c, s)))
    bad = ~torch.isfinite(x)
    nan = torch.full_like(sin, math.nan)
    return torch.where(bad, nan, sin), torch.where(bad, nan, cos)


def sin(x: torch.Tensor) -> torch.Tensor:
    return _sin_cos64(x)[0].float()


def cos(x: torch.Tensor) -> torch.Tensor:
    return _sin_cos64(x)[1].float()
