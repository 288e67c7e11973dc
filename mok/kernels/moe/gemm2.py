"""The grouped GEMM of the MoE layer: C[row] = A[row] @ B[e] with B[e] addressed by strides, so one kernel serves
GEMM 2 (y = act @ w2[e]^T), the backward's d act (with the SwiGLU backward epilogue: d gate_up) and d hidden.
Launchers: grouped_gemm.launch_gemm2, launch_bwd_act, launch_bwd_dx.

Shapes: docs/shapes.md. Kernel rules: grouped_gemm.py's docstring and docs/kernels.md.
"""
from __future__ import annotations

import triton
import triton.language as tl

from mok.kernels.launch import cached_launch, wait_for_predecessor
from mok.kernels.moe.gemm_tiles import ROWS_POSITION, _dot, _gemm_rows, _swizzle

# How the grouped GEMM loads B[e] (the TMA_B constexpr of _grouped_gemm_kernel).
TMA_B_OFF = tl.constexpr(0)  # pointer loads
TMA_B_NK = tl.constexpr(1)  # B[e] stored [n, k] (k contiguous): descriptor [E * n, k], block [BLOCK_N, BLOCK_K]
TMA_B_KN = tl.constexpr(2)  # B[e] stored [k, n] (n contiguous): descriptor [E * k, n], block [BLOCK_K, BLOCK_N]


@triton.jit
def _prefetch_l2(b_ptr, pid_n, n_cols, k_dim, stride_bn, BLOCK_N: tl.constexpr, PREFETCH_K: tl.constexpr,
                 LINE: tl.constexpr):
    """Prefetch into L2 (evict_last) the 128-byte lines of B[e][:PREFETCH_K, column block pid_n] (b_ptr: B[e],
    stored with k contiguous, LINE elements per line): one prefetch per line; lanes past the tile prefetch
    B[e]'s first line again."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, PREFETCH_K // LINE) * LINE
    inside = (offs_k < k_dim)[:, None] & (offs_n < n_cols)[None, :]
    ptrs = tl.where(inside, b_ptr + offs_k[:, None] + offs_n[None, :].to(tl.int64) * stride_bn, b_ptr)
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [ptrs.to(tl.int64)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _swiglu_backward_store(acc, gate, up, c_ptrs, n_cols, stride_cn, mask):
    """The SwiGLU backward of one tile: d gate_up = round(d act * d(silu(gate) * up)) stored at c_ptrs
    (d gate) and n_cols columns further (d up). acc: d act fp32; gate, up: the saved tiles (activation dtype)."""
    gate = gate.to(tl.float32)
    up = up.to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    grad_gate = acc * up * sig * (1.0 + gate * (1.0 - sig))
    grad_up = acc * (gate * sig)
    tl.store(c_ptrs, grad_gate.to(c_ptrs.dtype.element_ty), mask=mask)
    tl.store(c_ptrs + n_cols * stride_cn, grad_up.to(c_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _lean_ptrs(base_ptr, rows, stride_row, cols, stride_col, LEAN_EPILOGUE: tl.constexpr):
    """[rows, cols] pointers of the lean epilogue: LEAN_EPILOGUE 1: base + int32 offsets (the launcher checks that
    they fit); 2: per-row int64 bases plus int32 column offsets (any size)."""
    if LEAN_EPILOGUE == 1:
        return base_ptr + (rows.to(tl.int32)[:, None] * stride_row + cols[None, :] * stride_col)
    else:
        return (base_ptr + rows.to(tl.int64) * stride_row)[:, None] + (cols * stride_col)[None, :]


@triton.jit
def _swiglu_backward_lean(acc, gate_up_ptr, c_ptr, positions, c_rows, offs_n, mask_m, n_cols, stride_cm, stride_cn,
                          LEAN_EPILOGUE: tl.constexpr):
    """_swiglu_backward_store for columns offs_n with its gate / up tiles loaded here, addressed by _lean_ptrs."""
    mask = mask_m[:, None] & (offs_n < n_cols)[None, :]
    gu_ptrs = _lean_ptrs(gate_up_ptr, positions, 2 * n_cols, offs_n, 1, LEAN_EPILOGUE)
    gate = tl.load(gu_ptrs, mask=mask, other=0.0)
    up = tl.load(gu_ptrs + n_cols, mask=mask, other=0.0)
    c_ptrs = _lean_ptrs(c_ptr, c_rows, stride_cm, offs_n, stride_cn, LEAN_EPILOGUE)
    _swiglu_backward_store(acc, gate, up, c_ptrs, n_cols, stride_cn, mask)


@cached_launch
@triton.jit
def _grouped_gemm_kernel(
    a_ptr, a_desc, b_ptr, b_desc, c_ptr, gate_up_ptr,
    ids_ptr, sorted_slots_ptr, expert_start_ptr, tile_expert_ptr, tile_row_start_ptr, num_tiles_ptr,
    max_tiles, num_experts, n_cols, k_dim,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
    A_ROWS: tl.constexpr, C_ROWS: tl.constexpr, SWIGLU_BACKWARD: tl.constexpr,
    LEAN_EPILOGUE: tl.constexpr, TOP_K: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    TMA_A: tl.constexpr, TMA_B: tl.constexpr, SCANNED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_KP: tl.constexpr,
    PDL: tl.constexpr, PREFETCH_K: tl.constexpr, LINE: tl.constexpr,
):
    """C[row] = A[row] @ B[e] for the schedule rows of each expert e (B[e] addressed by strides, so
    w2[e]^T (GEMM 2), w2[e] (d act) and w13[e] (d hidden) all fit).

    A_ROWS / C_ROWS say how a schedule position p addresses A / C: ROWS_POSITION or ROWS_SLOT.
    SWIGLU_BACKWARD: C is d act [N, I]; instead of storing it, load gate/up at the same rows and
    store d gate_up = round(d act * d(silu(gate) * up)) into c_ptr ([N, 2I]).
    LEAN_EPILOGUE: the epilogue with fewer live registers: C (and gate / up) addressed after the K loop, from int32
    offsets (1; the launcher takes 2 where an offset could pass 2^31) or from int64 row bases plus int32 column
    offsets (2), and the SwiGLU backward on two column halves of the accumulator. Same values, far fewer spilled
    registers per thread under Triton 3.6 for sm_90 (docs/kernels.md, "LEAN_EPILOGUE").
    TMA_A (only with A_ROWS == ROWS_POSITION): A tiles through a_desc ([N, k_dim], block
    [BLOCK_M, BLOCK_K]); rows past the tile's expert only reach masked outputs, columns past k_dim are zeros.
    TMA_B: TMA_B_NK: B[e] stored [n_cols, k_dim]: b_desc is [E * n_cols, k_dim], block [BLOCK_N, BLOCK_K],
    columns past k_dim are zeros, rows past n_cols only reach masked outputs. TMA_B_KN: B[e] stored
    [k_dim, n_cols]: b_desc is [E * k_dim, n_cols], block [BLOCK_K, BLOCK_N]; the launcher allows it only
    when BLOCK_K divides k_dim (no tile crosses into the next expert along the reduction).
    PDL: launched with programmatic dependent launch (mok/kernels/launch.py). PREFETCH_K > 0 (GEMM 2 of a
    decode step: SCANNED, with PDL; B[e] with k contiguous, LINE elements per 128-byte line): before its wait
    the program scans the ids once to guess its tile and prefetches the first PREFETCH_K reduction steps of
    that tile's weights into L2 while GEMM 1 still runs. The guess only chooses what to prefetch (ids read
    before the wait may be stale; valid_ids keeps any value's addresses inside w2): the rows the program
    computes come from a second scan after the wait, as without the prefetch, so values and bits do not change.
    """
    pid_m, pid_n = _swizzle(tl.program_id(0), max_tiles, tl.cdiv(n_cols, BLOCK_N), GROUP_M)
    if PREFETCH_K > 0:
        guess_runs, guess_expert, _, _, _, _, _ = _gemm_rows(
            ids_ptr, sorted_slots_ptr, expert_start_ptr, tile_expert_ptr, tile_row_start_ptr, num_tiles_ptr,
            max_tiles, num_experts, pid_m, SCANNED, TOP_K, BLOCK_T, BLOCK_KP, BLOCK_M)
        if guess_runs != 0:
            _prefetch_l2(b_ptr + guess_expert * stride_be, pid_n, n_cols, k_dim, stride_bn, BLOCK_N, PREFETCH_K,
                         LINE)
    wait_for_predecessor(PDL)
    runs, expert, row_start, positions, mask_m, slots, tokens = _gemm_rows(
        ids_ptr, sorted_slots_ptr, expert_start_ptr, tile_expert_ptr, tile_row_start_ptr, num_tiles_ptr, max_tiles,
        num_experts, pid_m, SCANNED, TOP_K, BLOCK_T, BLOCK_KP, BLOCK_M)
    if runs == 0:
        return
    if A_ROWS == ROWS_POSITION:
        a_rows = positions
    else:
        a_rows = slots
    if C_ROWS == ROWS_POSITION:
        c_rows = positions
    else:
        c_rows = slots
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n_cols
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :].to(tl.int64) * stride_bn
    if TMA_B == TMA_B_NK:
        desc_row = expert.to(tl.int32) * n_cols + pid_n * BLOCK_N
    else:
        desc_row = expert.to(tl.int32) * k_dim
    mask_mn = mask_m[:, None] & mask_n[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        mask_k = offs_k < k_dim - k0
        if TMA_A:
            a = a_desc.load([row_start, k0])
        else:
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if TMA_B == TMA_B_NK:
            b = tl.trans(b_desc.load([desc_row, k0]))
        elif TMA_B == TMA_B_KN:
            b = b_desc.load([desc_row + k0, pid_n * BLOCK_N])
        else:
            b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = _dot(a, b, acc, UPCAST)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    out_dtype = c_ptr.dtype.element_ty
    if SWIGLU_BACKWARD and LEAN_EPILOGUE:
        acc_lo, acc_hi = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, BLOCK_N // 2]), [0, 2, 1]))
        offs_lo = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 2)
        _swiglu_backward_lean(acc_lo, gate_up_ptr, c_ptr, positions, c_rows, offs_lo, mask_m, n_cols, stride_cm,
                              stride_cn, LEAN_EPILOGUE)
        _swiglu_backward_lean(acc_hi, gate_up_ptr, c_ptr, positions, c_rows, offs_lo + BLOCK_N // 2, mask_m, n_cols,
                              stride_cm, stride_cn, LEAN_EPILOGUE)
    elif SWIGLU_BACKWARD:
        gu_ptrs = gate_up_ptr + positions[:, None] * (2 * n_cols) + offs_n[None, :]
        gate = tl.load(gu_ptrs, mask=mask_mn, other=0.0)
        up = tl.load(gu_ptrs + n_cols, mask=mask_mn, other=0.0)
        c_ptrs = c_ptr + c_rows[:, None] * stride_cm + offs_n[None, :] * stride_cn
        _swiglu_backward_store(acc, gate, up, c_ptrs, n_cols, stride_cn, mask_mn)
    elif LEAN_EPILOGUE:
        c_ptrs = _lean_ptrs(c_ptr, c_rows, stride_cm, offs_n, stride_cn, LEAN_EPILOGUE)
        tl.store(c_ptrs, acc.to(out_dtype), mask=mask_mn)
    else:
        c_ptrs = c_ptr + c_rows[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(out_dtype), mask=mask_mn)
