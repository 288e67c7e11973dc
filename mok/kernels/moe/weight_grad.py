"""The weight gradients of the MoE layer: C[e] = A_e^T @ B_e over expert e's schedule rows, in order (d w2 and
d w13). Launchers: grouped_gemm.launch_weight_grad_w2, launch_weight_grad_w13.

Shapes: docs/shapes.md. Kernel rules: grouped_gemm.py's docstring and docs/kernels.md.
"""
from __future__ import annotations

import triton
import triton.language as tl

from mok.kernels.launch import cached_launch
from mok.kernels.moe.gemm_tiles import ROWS_POSITION, ROWS_SLOT, _dot


@triton.jit
def _weight_grad_rows(ROWS: tl.constexpr, positions, sorted_slots_ptr, mask_r, TOP_K: tl.constexpr):
    """Rows of one operand for schedule positions: ROWS_POSITION, ROWS_SLOT or ROWS_TOKEN."""
    if ROWS == ROWS_POSITION:
        rows = positions
    else:
        slots = tl.load(sorted_slots_ptr + positions, mask=mask_r, other=0).to(tl.int64)
        if ROWS == ROWS_SLOT:
            rows = slots
        else:
            rows = slots // TOP_K
    return rows


@triton.jit
def _weight_grad_chunk(acc, a_ptr, b_ptr, sorted_slots_ptr, r0, row_end, offs_m, offs_n, mask_m, mask_n,
                       stride_ar, stride_ac, stride_br, stride_bc, A_ROWS: tl.constexpr, B_ROWS: tl.constexpr,
                       TOP_K: tl.constexpr, UPCAST: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + A[rows r0 .. r0 + BLOCK_K)^T @ B[same rows] through pointer loads, rows from row_end on masked to
    zero: one reduction step of a weight gradient."""
    positions = (r0 + tl.arange(0, BLOCK_K)).to(tl.int64)
    mask_r = positions < row_end
    rows_a = _weight_grad_rows(A_ROWS, positions, sorted_slots_ptr, mask_r, TOP_K)
    rows_b = _weight_grad_rows(B_ROWS, positions, sorted_slots_ptr, mask_r, TOP_K)
    a = tl.load(a_ptr + rows_a[None, :] * stride_ar + offs_m[:, None] * stride_ac,
                mask=mask_m[:, None] & mask_r[None, :], other=0.0)
    b = tl.load(b_ptr + rows_b[:, None] * stride_br + offs_n[None, :] * stride_bc,
                mask=mask_r[:, None] & mask_n[None, :], other=0.0)
    return _dot(a, b, acc, UPCAST)


@cached_launch
@triton.jit
def _weight_grad_kernel(
    a_ptr, a_desc, b_ptr, b_desc, c_ptr, sorted_slots_ptr, expert_start_ptr,
    m_dim, n_dim, stride_ar, stride_ac, stride_br, stride_bc, stride_ce, stride_cm, stride_cn,
    A_ROWS: tl.constexpr, B_ROWS: tl.constexpr, TOP_K: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA_A: tl.constexpr, TMA_B: tl.constexpr,
):
    """C[e] = sum over expert e's schedule rows r, in order: A[row_a(r), :m_dim]^T (x) B[row_b(r), :n_dim].

    One program per (output tile, expert); the loop over the expert's rows is sequential, so the
    reduction order is fixed (deterministic, no atomics). Row addressing (A_ROWS / B_ROWS):
    ROWS_POSITION, ROWS_SLOT or ROWS_TOKEN. Empty experts store zeros.
    TMA_A / TMA_B (only for operands addressed by schedule position): the expert's full chunks of
    BLOCK_K rows load through a_desc ([N, m_dim], block [BLOCK_K, BLOCK_M]) / b_desc ([N, n_dim],
    block [BLOCK_K, BLOCK_N]), so no TMA box ever reaches another expert's rows; the last partial chunk
    takes the masked pointer path. Same chunks, same values, same order as without TMA: same bits.
    """
    num_pid_n = tl.cdiv(n_dim, BLOCK_N)
    pid_m = tl.program_id(0) // num_pid_n
    pid_n = tl.program_id(0) % num_pid_n
    expert = tl.program_id(1).to(tl.int64)
    row_start = tl.load(expert_start_ptr + expert)
    row_end = tl.load(expert_start_ptr + expert + 1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < m_dim
    mask_n = offs_n < n_dim
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    full_end = row_start
    if TMA_A or TMA_B:
        full_end = row_start + (row_end - row_start) // BLOCK_K * BLOCK_K
    for r0 in range(row_start, full_end, BLOCK_K):  # full chunks (TMA configs only)
        positions = (r0 + tl.arange(0, BLOCK_K)).to(tl.int64)
        mask_r = positions < row_end
        if TMA_A:
            a = tl.trans(a_desc.load([r0, pid_m * BLOCK_M]))
        else:
            rows_a = _weight_grad_rows(A_ROWS, positions, sorted_slots_ptr, mask_r, TOP_K)
            a = tl.load(a_ptr + rows_a[None, :] * stride_ar + offs_m[:, None] * stride_ac,
                        mask=mask_m[:, None] & mask_r[None, :], other=0.0)
        if TMA_B:
            b = b_desc.load([r0, pid_n * BLOCK_N])
        else:
            rows_b = _weight_grad_rows(B_ROWS, positions, sorted_slots_ptr, mask_r, TOP_K)
            b = tl.load(b_ptr + rows_b[:, None] * stride_br + offs_n[None, :] * stride_bc,
                        mask=mask_r[:, None] & mask_n[None, :], other=0.0)
        acc = _dot(a, b, acc, UPCAST)
    for r0 in range(full_end, row_end, BLOCK_K):  # every chunk without TMA; the partial tail with it
        acc = _weight_grad_chunk(acc, a_ptr, b_ptr, sorted_slots_ptr, r0, row_end, offs_m, offs_n, mask_m, mask_n,
                                 stride_ar, stride_ac, stride_br, stride_bc, A_ROWS, B_ROWS, TOP_K, UPCAST, BLOCK_K)
    c_ptrs = c_ptr + expert * stride_ce + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
