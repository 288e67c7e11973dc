"""Triton rotary embedding behind mok.rotary.

Shapes: docs/shapes.md (x_TQD: Q heads, query or key/value heads alike; R the rotary dim, R / 2
frequencies; P table rows, positions 0..P-1). One program per token rotates all its heads: element-wise,
batch-invariant. Semantics in mok/reference/rotary.py: the fp32 inv_freq comes from the host (the same
tensor as the CPU path, YaRN's blend included), angle = fp32(position) * inv_freq, cos/sin evaluated in fp64 and
rounded to fp32, times YaRN's fp32 attention factor (1.0 without YaRN: exact), rotation in fp32, one rounding.

cos/sin table. The fp64 cos/sin of the formula cost more than the rotation itself, so the kernel reads
them from a cached fp32 table cos_sin_P2F [P, 2, R / 2] (row p: the cos of position p, then its sin)
computed once per (theta, R, YaRN, device) by _cos_sin_table_kernel, which evaluates the formula through the
same jitted function (_cos_sin) the rotation kernel uses for positions outside the table: fp32(position)
* inv_freq (one fp32 rounding), cast to fp64, tl.cos / tl.sin (libdevice's fp64 cos/sin on CUDA, exact
element-wise functions of their input), rounded once to fp32. Each table entry is therefore the value the
per-token computation gives for that position, and a token reads the table only when 0 <= position < P;
any other position (beyond the table, negative) takes the per-token branch. Either way the bits are those
of the formula: the table changes speed, never values (tests/mok/test_rotary_table.py, interpreter;
tests/mok/test_dense_gpu.py, GPU).

Table size, without reading positions on the host (they live on the GPU; reading them would synchronise):
P = the largest of 4096, next_power_of_2(T) (packed training/prefill batches: a sequence's positions are
below the batch's T) capped at _AUTO_TABLE_BYTES, and next_power_of_2 of the caller's `max_positions` (e.g. the
model's max_position_embeddings, so that decode and chunked prefill at large positions use the table too)
capped at _MAX_TABLE_BYTES (a model of a million positions would otherwise hold half a GB per table).
A call that wants more rows than the cached table has rebuilds it larger (by powers of two, so the retired
tables together stay smaller than the live one); the smaller table is kept alive
(_RETIRED), because a CUDA graph captured earlier may still read it. Inside CUDA-graph capture nothing is
built (the memory would belong to the graph's pool): the cached table is used as it is, or none, and the
positions it does not cover take the per-token branch. Building is sync-free (inv_freq is filled from
Python floats, the table by a kernel), so even a first call may run under torch.cuda.set_sync_debug_mode.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok.kernels.launch import cached_launch
from mok.kernels.layout import last_dim_contiguous
from mok.reference.rotary import YarnScaling
from mok.reference.rotary import inv_freq as _inv_freq_cpu

_MIN_TABLE_ROWS = 4096
_AUTO_TABLE_BYTES = 64 << 20  # growth from the token count alone stops here (2^17 rows at R = 128)
_MAX_TABLE_BYTES = 256 << 20  # growth from max_positions stops here (2^19 rows at R = 128)
_TABLE_BLOCK_ELEMENTS = 1024  # table build: rows per program = this / next_power_of_2(R / 2)


@triton.jit
def _cos_sin(position_f32, inv_freq, attention_factor):
    """The formula: cos, sin in fp32 of angle = position * inv_freq (fp32), evaluated in fp64, each times the fp32
    attention_factor (one rounding; exact for 1.0)."""
    angle = (position_f32 * inv_freq).to(tl.float64)
    return tl.cos(angle).to(tl.float32) * attention_factor, tl.sin(angle).to(tl.float32) * attention_factor


@cached_launch
@triton.jit
def _cos_sin_table_kernel(table_ptr, inv_freq_ptr, num_rows, half, attention_factor, BLOCK_ROWS: tl.constexpr,
                          BLOCK_HALF: tl.constexpr):
    """table [P, 2, R / 2] fp32: row p holds _cos_sin(fp32(p), inv_freq, attention_factor), cos then sin."""
    p = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64)
    f = tl.arange(0, BLOCK_HALF)
    f_ok = f < half
    inv_freq = tl.load(inv_freq_ptr + f, mask=f_ok, other=0.0)
    # the int64 -> fp32 cast of the positions
    cos, sin = _cos_sin(p.to(tl.float32)[:, None], inv_freq[None, :], attention_factor)
    mask = (p < num_rows)[:, None] & f_ok[None, :]
    row = table_ptr + p[:, None] * (2 * half) + f[None, :]
    tl.store(row, cos, mask=mask)
    tl.store(row + half, sin, mask=mask)


@cached_launch
@triton.jit
def _rotary_kernel(
    x_ptr, out_ptr, positions_ptr, inv_freq_ptr, table_ptr, table_rows,
    num_heads, half, stride_xt, stride_xh, stride_ot, stride_oh, sin_sign, attention_factor,
    NEOX: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    f = tl.arange(0, BLOCK_HALF)
    f_ok = f < half
    position_i = tl.load(positions_ptr + t)
    if (position_i >= 0) & (position_i < table_rows):
        row = table_ptr + position_i.to(tl.int64) * (2 * half)
        cos_f = tl.load(row + f, mask=f_ok, other=1.0)
        sin_f = tl.load(row + half + f, mask=f_ok, other=0.0)
    else:  # outside the table: the formula per token (the table holds its values)
        cos_f, sin_f = _cos_sin(position_i.to(tl.float32), tl.load(inv_freq_ptr + f, mask=f_ok, other=0.0),
                                attention_factor)
    cos = cos_f[None, :]
    sin = (sin_f * sin_sign)[None, :]
    h = tl.arange(0, BLOCK_HEADS)
    mask = (h < num_heads)[:, None] & f_ok[None, :]
    if NEOX:
        i1 = f
        i2 = f + half
    else:
        i1 = 2 * f
        i2 = 2 * f + 1
    x_base = x_ptr + t * stride_xt + h[:, None] * stride_xh
    o_base = out_ptr + t * stride_ot + h[:, None] * stride_oh
    x1 = tl.load(x_base + i1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_base + i2[None, :], mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
    tl.store(o_base + i1[None, :], out1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_base + i2[None, :], out2.to(out_ptr.dtype.element_ty), mask=mask)


_Key = tuple[float, int, YarnScaling | None, torch.device]  # (theta, R, YaRN, device)
_INV_FREQ_CACHE: dict[_Key, torch.Tensor] = {}
_TABLE_CACHE: dict[_Key, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # tables replaced by larger ones: a captured CUDA graph may still read them


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _inv_freq(theta: float, rotary_dim: int, device: torch.device, yarn: YarnScaling | None = None) -> torch.Tensor:
    """The host's fp32 inv_freq on `device`, cached. Filled element by element from Python floats (each an
    fp32 value, so the fill is exact) instead of a host-to-device copy, which would synchronise with the
    host; so even a first call is sync-free and may run inside CUDA-graph capture (then not cached: the
    tensor would belong to the graph's memory pool)."""
    key = (theta, rotary_dim, yarn, device)
    cached = _INV_FREQ_CACHE.get(key)
    if cached is not None:
        return cached
    values = _inv_freq_cpu(theta, rotary_dim, yarn).tolist()
    inv_freq = torch.empty(len(values), dtype=torch.float32, device=device)
    for i, value in enumerate(values):
        inv_freq[i].fill_(value)
    if not _capturing(inv_freq.device):
        _INV_FREQ_CACHE[key] = inv_freq
    return inv_freq


def table_rows_wanted(num_tokens: int, rotary_dim: int, max_positions: int = 0) -> int:
    """Rows P of the table a call of num_tokens tokens asks for (module docstring): sizes only, no values."""
    half = rotary_dim // 2

    def rows_in(budget_bytes: int) -> int:  # a power of two of rows of 2 * R / 2 fp32 values
        fits = max(1, budget_bytes // (8 * half))
        return max(_MIN_TABLE_ROWS, 1 << (fits.bit_length() - 1))

    auto = min(triton.next_power_of_2(max(num_tokens, _MIN_TABLE_ROWS)), rows_in(_AUTO_TABLE_BYTES))
    asked = min(triton.next_power_of_2(int(max_positions)), rows_in(_MAX_TABLE_BYTES)) if max_positions > 0 else 0
    return max(auto, asked)


def build_cos_sin_table(inv_freq: torch.Tensor, num_rows: int, attention_factor: float = 1.0) -> torch.Tensor:
    """fp32 [num_rows, 2, R / 2]: cos, sin of positions 0..num_rows-1 by the formula (_cos_sin)."""
    half = inv_freq.shape[0]
    table = torch.empty(num_rows, 2, half, dtype=torch.float32, device=inv_freq.device)
    block_half = triton.next_power_of_2(half)
    block_rows = max(1, _TABLE_BLOCK_ELEMENTS // block_half)
    _cos_sin_table_kernel[(triton.cdiv(num_rows, block_rows),)](
        table, inv_freq, num_rows, half, float(attention_factor), BLOCK_ROWS=block_rows, BLOCK_HALF=block_half,
        num_warps=4)
    return table


def cos_sin_table(theta: float, rotary_dim: int, device: torch.device, rows: int, yarn: YarnScaling | None = None
                  ) -> torch.Tensor | None:
    """The cached table of (theta, rotary_dim, yarn, device), rebuilt with `rows` rows when it has fewer (never
    while capturing a CUDA graph: then the cached one, or None)."""
    key = (theta, rotary_dim, yarn, device)
    cached = _TABLE_CACHE.get(key)
    if (cached is not None and cached.shape[0] >= rows) or _capturing(device):
        return cached
    table = build_cos_sin_table(_inv_freq(theta, rotary_dim, device, yarn), rows,
                                1.0 if yarn is None else yarn.attention_factor)
    if cached is not None:
        _RETIRED.append(cached)
    _TABLE_CACHE[key] = table
    return table


def clear_tables() -> None:
    """Forget the cached tables (tests: the next call builds anew); they stay allocated (_RETIRED)."""
    _RETIRED.extend(_TABLE_CACHE.values())
    _TABLE_CACHE.clear()


def rotary(
    x_TQD: torch.Tensor, positions_T: torch.Tensor, theta: float, rotary_dim: int, neox_style: bool, inverse: bool,
    max_positions: int = 0, use_table: bool = True, yarn: YarnScaling | None = None,
) -> torch.Tensor:
    """[T, Q, D] -> [T, Q, D] in x's dtype; features past rotary_dim are copied. max_positions: a bound the
    caller knows on the positions (table size, module docstring); use_table=False (tests): every token
    takes the per-token branch; yarn: YaRN's inv_freq and attention factor (mok/reference/rotary.py)."""
    x_TQD = last_dim_contiguous(x_TQD)
    num_tokens, num_heads, head_dim = x_TQD.shape
    out_TQD = torch.empty_like(x_TQD) if rotary_dim == head_dim else x_TQD.clone()
    if num_tokens and num_heads:
        half = rotary_dim // 2
        device = x_TQD.device
        inv_freq = _inv_freq(theta, rotary_dim, device, yarn)
        table = None
        if use_table:
            table = cos_sin_table(theta, rotary_dim, device, table_rows_wanted(num_tokens, rotary_dim, max_positions),
                                  yarn)
        _rotary_kernel[(num_tokens,)](
            x_TQD, out_TQD, positions_T.contiguous(), inv_freq, inv_freq if table is None else table,
            0 if table is None else table.shape[0],
            num_heads, half, x_TQD.stride(0), x_TQD.stride(1), out_TQD.stride(0), out_TQD.stride(1),
            -1.0 if inverse else 1.0, 1.0 if yarn is None else float(yarn.attention_factor),
            NEOX=neox_style, BLOCK_HEADS=triton.next_power_of_2(num_heads), BLOCK_HALF=triton.next_power_of_2(half),
            num_warps=4,
        )
    return out_TQD
