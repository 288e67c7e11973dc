"""Triton kernels of the MoE layer (CUDA; the logic also runs under TRITON_INTERPRET=1 on CPU tensors).

Legend: T tokens, H hidden size, I expert intermediate size, E experts, K top-k, N = T * K slots
(slot n = t * K + k), S = the N slots in schedule order (grouped by expert, stable by slot),
BM/BN/BK tile sizes along rows / output columns / the reduction.

Semantics and rounding points: mok/reference/moe.py (the CPU path) — the same here.

Determinism and batch invariance:
- The schedule is a stable sort of the slots by expert (torch.sort(stable=True) + searchsorted: no
  atomics), so an expert's rows are in slot order whatever the batch.
- Every GEMM walks its reduction dimension in one sequential loop of BLOCK_K steps with an fp32
  accumulator: no split-K, no stream-K, no TF32 (bf16/fp16 operands; fp32 operands use
  input_precision="ieee"). BLOCK_K is the same for every config, and a row's bits then do not
  depend on BM/BN/warps/stages (measured on the H200, KERNEL-NOTES.md; re-proved per kernel by
  tests/test_moe_gpu.py), which is why the config may follow the token count.
- The combine sums the K contributions of a token in order k = 0..K-1 in fp32; each token's slots
  are written by exactly one program, so no atomics anywhere.
- Backward: weight gradients reduce over an expert's rows in schedule order in one program per
  output tile (sequential over row chunks); d hidden is stored per slot and summed over k in order.
  Optional layouts (SORTED_DY, SORTED_X) only move rows (d y in schedule order, x gathered into
  schedule order): same values, same reduction order, same bits.

File layout: kernels -> launchers -> adapters (route, replay_weights, moe_forward, moe_backward).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# ============================================================================================
# kernels
# ============================================================================================


@triton.jit
def _route_kernel(logits_ptr, ids_ptr, weights_ptr, probs_ptr, num_experts, stride_logits,
                  TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                  RENORMALIZE: tl.constexpr, REPLAY: tl.constexpr):
    """One program per token: fp32 softmax over E, top-k by value (ties -> lower index), renormalize.

    The reduction trees of max/sum depend only on BLOCK_E (chosen from E), never on T.
    REPLAY: ids are given (read from ids_ptr) and only their weights are computed.
    """
    token = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < num_experts
    logits = tl.load(logits_ptr + token * stride_logits + offs_e, mask=mask_e, other=-float("inf")).to(tl.float32)
    row_max = tl.max(logits, axis=0)
    numer = tl.where(mask_e, tl.exp(logits - row_max), 0.0)
    probs = numer / tl.sum(numer, axis=0)
    tl.store(probs_ptr + token * num_experts + offs_e, probs, mask=mask_e)

    offs_k = tl.arange(0, BLOCK_K)
    selected = tl.zeros([BLOCK_K], dtype=tl.float32)
    selected_ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    remaining = tl.where(mask_e, probs, -1.0)  # probabilities are >= 0: -1 marks "not eligible"
    total = tl.zeros([], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        if REPLAY:
            idx = tl.load(ids_ptr + token * TOP_K + j).to(tl.int32)
            value = tl.max(tl.where(offs_e == idx, probs, -1.0), axis=0)
        else:
            value = tl.max(remaining, axis=0)
            idx = tl.min(tl.where(remaining == value, offs_e, BLOCK_E), axis=0).to(tl.int32)
            remaining = tl.where(offs_e == idx, -1.0, remaining)
        selected = tl.where(offs_k == j, value, selected)
        selected_ids = tl.where(offs_k == j, idx, selected_ids)
        total = total + value  # sequential, k = 0..K-1
    if RENORMALIZE:
        selected = selected / total
    mask_k = offs_k < TOP_K
    tl.store(weights_ptr + token * TOP_K + offs_k, selected, mask=mask_k)
    if not REPLAY:
        tl.store(ids_ptr + token * TOP_K + offs_k, selected_ids, mask=mask_k)


@triton.jit
def _schedule_kernel(ids_ptr, sorted_slots_ptr, expert_start_ptr, tile_expert_ptr, tile_row_start_ptr, num_tiles_ptr,
                     num_slots, num_experts, max_tiles,
                     SORT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """One program: the schedule and the row tiles of one BLOCK_M, in one launch (for small batches,
    where the ~15 torch launches of the general path cost more than the GEMMs).

    SORT: stable counting sort of the slots by expert (position = expert start + earlier slots of
    the same expert), writing sorted_slots [S] and expert_start [E + 1]; otherwise expert_start is
    read. Then the tiles exactly as Schedule.tiles computes them. Integer work only: its results
    equal the torch path's, element for element.
    """
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < num_experts
    offs_c = tl.arange(0, CHUNK)
    if SORT:
        counts = tl.zeros([BLOCK_E], dtype=tl.int32)
        for c0 in range(0, num_slots, CHUNK):
            ids = tl.load(ids_ptr + c0 + offs_c, mask=c0 + offs_c < num_slots, other=BLOCK_E)
            counts += tl.sum((ids[:, None] == offs_e[None, :]).to(tl.int32), axis=0)
        start = tl.cumsum(counts, 0) - counts
        tl.store(expert_start_ptr + offs_e, start, mask=mask_e)
        tl.store(expert_start_ptr + num_experts, tl.sum(counts, axis=0))
        running = start
        for c0 in range(0, num_slots, CHUNK):
            mask_c = c0 + offs_c < num_slots
            ids = tl.load(ids_ptr + c0 + offs_c, mask=mask_c, other=BLOCK_E)
            onehot = ids[:, None] == offs_e[None, :]
            base = tl.sum(tl.where(onehot, running[None, :], 0), axis=1)
            earlier_same = (ids[:, None] == ids[None, :]) & (offs_c[None, :] < offs_c[:, None])
            rank = tl.sum(earlier_same.to(tl.int32), axis=1)
            tl.store(sorted_slots_ptr + base + rank, c0 + offs_c, mask=mask_c)
            running += tl.sum(onehot.to(tl.int32), axis=0)
    else:
        start = tl.load(expert_start_ptr + offs_e, mask=mask_e, other=0)
        counts = tl.load(expert_start_ptr + offs_e + 1, mask=mask_e, other=0) - start
    tiles_per_expert = (counts + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles_per_expert, 0)
    tile_first = tile_end - tiles_per_expert
    tl.store(num_tiles_ptr, tl.sum(tiles_per_expert, axis=0))
    for t0 in range(0, max_tiles, CHUNK):
        tiles = t0 + offs_c
        # searchsorted(tile_end, tile, right=True), clamped to the last expert
        expert = tl.sum(((tile_end[None, :] <= tiles[:, None]) & mask_e[None, :]).to(tl.int32), axis=1)
        expert = tl.minimum(expert, num_experts - 1)
        onehot = expert[:, None] == offs_e[None, :]
        first = tl.sum(tl.where(onehot, tile_first[None, :], 0), axis=1)
        row_start = tl.sum(tl.where(onehot, start[None, :], 0), axis=1) + (tiles - first) * BLOCK_M
        mask_t = tiles < max_tiles
        tl.store(tile_expert_ptr + tiles, expert, mask=mask_t)
        tl.store(tile_row_start_ptr + tiles, row_start, mask=mask_t)


@triton.jit
def _dot(a, b, acc, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b with an fp32 accumulator. UPCAST (interpreter only: its tl.dot multiplies the raw
    storage bits of bf16 operands) feeds exact fp32 copies instead; never set on a GPU."""
    if UPCAST:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    return acc


@triton.jit
def _tile_rows(tile_expert_ptr, tile_row_start_ptr, expert_start_ptr, sorted_slots_ptr, pid_m,
               TOP_K: tl.constexpr, BLOCK_M: tl.constexpr):
    """Rows of row-tile pid_m: (expert, first position, schedule positions [BM], row mask, slots [BM], tokens [BM])."""
    expert = tl.load(tile_expert_ptr + pid_m)
    row_start = tl.load(tile_row_start_ptr + pid_m)
    row_end = tl.load(expert_start_ptr + expert + 1)
    positions = (row_start + tl.arange(0, BLOCK_M)).to(tl.int64)
    mask_m = positions < row_end
    slots = tl.load(sorted_slots_ptr + positions, mask=mask_m, other=0).to(tl.int64)
    return expert.to(tl.int64), row_start, positions, mask_m, slots, slots // TOP_K


@triton.jit
def _swizzle(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Group GROUP_M row tiles per column sweep (L2 reuse of the weight tiles)."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _gemm1_swiglu_kernel(
    x_ptr, w13_ptr, w13_desc, gate_up_ptr, act_ptr,
    sorted_slots_ptr, expert_start_ptr, tile_expert_ptr, tile_row_start_ptr, num_tiles_ptr,
    max_tiles, inter, hidden,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wk,
    TOP_K: tl.constexpr, SAVE_GATE_UP: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, TMA_B: tl.constexpr,
):
    """gate_up = x[token] @ w13[e]^T (gathered rows), act = silu(gate) * up, per schedule row.

    Output column block n covers gate columns n and up columns I + n (two accumulators), so the
    SwiGLU epilogue has both halves. gate/up are rounded to the activation dtype first (saved for
    the backward), then act = round(silu(gate) * up) in fp32.
    TMA_B: the weight tiles come through w13_desc (2-D [E * 2I, H], block [BN, BK]); rows past a
    half's end belong to other columns and only reach masked outputs; columns past H are zeros.
    """
    pid_m, pid_n = _swizzle(tl.program_id(0), max_tiles, tl.cdiv(inter, BLOCK_N), GROUP_M)
    if pid_m >= tl.load(num_tiles_ptr):
        return
    expert, row_start, positions, mask_m, slots, tokens = _tile_rows(
        tile_expert_ptr, tile_row_start_ptr, expert_start_ptr, sorted_slots_ptr, pid_m, TOP_K, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xh
    wg_ptrs = w13_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    wu_ptrs = wg_ptrs + inter * stride_wn
    desc_row = expert.to(tl.int32) * (2 * inter) + pid_n * BLOCK_N
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        mask_k = offs_k < hidden - k0
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if TMA_B:
            wg = tl.trans(w13_desc.load([desc_row, k0]))
            wu = tl.trans(w13_desc.load([desc_row + inter, k0]))
        else:
            wg = tl.load(wg_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            wu = tl.load(wu_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc_gate = _dot(a, wg, acc_gate, INPUT_PRECISION, UPCAST)
        acc_up = _dot(a, wu, acc_up, INPUT_PRECISION, UPCAST)
        a_ptrs += BLOCK_K * stride_xh
        wg_ptrs += BLOCK_K * stride_wk
        wu_ptrs += BLOCK_K * stride_wk
    out_dtype = act_ptr.dtype.element_ty
    gate = acc_gate.to(out_dtype)
    up = acc_up.to(out_dtype)
    mask_mn = mask_m[:, None] & mask_n[None, :]
    if SAVE_GATE_UP:
        gu_ptrs = gate_up_ptr + positions[:, None] * (2 * inter) + offs_n[None, :]
        tl.store(gu_ptrs, gate, mask=mask_mn)
        tl.store(gu_ptrs + inter, up, mask=mask_mn)
    gate_f = gate.to(tl.float32)
    act = gate_f / (1.0 + tl.exp(-gate_f)) * up.to(tl.float32)
    tl.store(act_ptr + positions[:, None] * inter + offs_n[None, :], act.to(out_dtype), mask=mask_mn)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, a_desc, b_ptr, b_desc, c_ptr, gate_up_ptr,
    sorted_slots_ptr, expert_start_ptr, tile_expert_ptr, tile_row_start_ptr, num_tiles_ptr,
    max_tiles, n_cols, k_dim,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
    A_ROWS: tl.constexpr, C_ROWS: tl.constexpr, SWIGLU_BACKWARD: tl.constexpr,
    TOP_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    TMA_A: tl.constexpr, TMA_B: tl.constexpr,
):
    """C[row] = A[row] @ B[e] for the schedule rows of each expert e (B[e] addressed by strides, so
    w2[e]^T (GEMM 2), w2[e] (d act) and w13[e] (d hidden) all fit).

    A_ROWS / C_ROWS say how a schedule position p addresses A / C: 0 = p itself, 1 = its slot.
    SWIGLU_BACKWARD: C is d act [S, I]; instead of storing it, load gate/up at the same rows and
    store d gate_up = round(d act * d(silu(gate) * up)) into c_ptr ([S, 2I]).
    TMA_A (only with A_ROWS == 0): A tiles through a_desc ([S, K], block [BM, BK]); rows past the
    tile's expert only reach masked outputs, columns past K are zeros.
    TMA_B: 1 = B[e] stored [N, K] (K contiguous): b_desc is [E * N, K], block [BN, BK], columns past
    K are zeros, rows past N only reach masked outputs. 2 = B[e] stored [K, N]: b_desc is
    [E * K, N], block [BK, BN]; the launcher allows it only when BK divides K (no tile crosses
    into the next expert along the reduction).
    """
    pid_m, pid_n = _swizzle(tl.program_id(0), max_tiles, tl.cdiv(n_cols, BLOCK_N), GROUP_M)
    if pid_m >= tl.load(num_tiles_ptr):
        return
    expert, row_start, positions, mask_m, slots, tokens = _tile_rows(
        tile_expert_ptr, tile_row_start_ptr, expert_start_ptr, sorted_slots_ptr, pid_m, TOP_K, BLOCK_M)
    if A_ROWS == 0:
        a_rows = positions
    else:
        a_rows = slots
    if C_ROWS == 0:
        c_rows = positions
    else:
        c_rows = slots
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n_cols
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :].to(tl.int64) * stride_bn
    if TMA_B == 1:
        desc_row = expert.to(tl.int32) * n_cols + pid_n * BLOCK_N
    else:
        desc_row = expert.to(tl.int32) * k_dim
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        mask_k = offs_k < k_dim - k0
        if TMA_A:
            a = a_desc.load([row_start, k0])
        else:
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if TMA_B == 1:
            b = tl.trans(b_desc.load([desc_row, k0]))
        elif TMA_B == 2:
            b = b_desc.load([desc_row + k0, pid_n * BLOCK_N])
        else:
            b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = _dot(a, b, acc, INPUT_PRECISION, UPCAST)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    mask_mn = mask_m[:, None] & mask_n[None, :]
    out_dtype = c_ptr.dtype.element_ty
    if SWIGLU_BACKWARD:
        gu_ptrs = gate_up_ptr + positions[:, None] * (2 * n_cols) + offs_n[None, :]
        gate = tl.load(gu_ptrs, mask=mask_mn, other=0.0).to(tl.float32)
        up = tl.load(gu_ptrs + n_cols, mask=mask_mn, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-gate))
        grad_gate = acc * up * sig * (1.0 + gate * (1.0 - sig))
        grad_up = acc * (gate * sig)
        c_ptrs = c_ptr + c_rows[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, grad_gate.to(out_dtype), mask=mask_mn)
        tl.store(c_ptrs + n_cols * stride_cn, grad_up.to(out_dtype), mask=mask_mn)
    else:
        c_ptrs = c_ptr + c_rows[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(out_dtype), mask=mask_mn)


@triton.jit
def _weight_grad_rows(ROWS: tl.constexpr, positions, sorted_slots_ptr, mask_r, TOP_K: tl.constexpr):
    """Rows of one operand for schedule positions: 0 = the position, 1 = its slot, 2 = its token."""
    if ROWS == 0:
        rows = positions
    else:
        slots = tl.load(sorted_slots_ptr + positions, mask=mask_r, other=0).to(tl.int64)
        if ROWS == 1:
            rows = slots
        else:
            rows = slots // TOP_K
    return rows


@triton.jit
def _weight_grad_kernel(
    a_ptr, a_desc, b_ptr, b_desc, c_ptr, sorted_slots_ptr, expert_start_ptr,
    m_dim, n_dim, stride_ar, stride_ac, stride_br, stride_bc, stride_ce, stride_cm, stride_cn,
    A_ROWS: tl.constexpr, B_ROWS: tl.constexpr, TOP_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA_A: tl.constexpr, TMA_B: tl.constexpr,
):
    """C[e] = sum over expert e's schedule rows r, in order: A[row_a(r), :M]^T (x) B[row_b(r), :N].

    One program per (output tile, expert); the loop over the expert's rows is sequential, so the
    reduction order is fixed (deterministic, no atomics). Row addressing: 0 = schedule position,
    1 = slot, 2 = token. Empty experts store zeros.
    TMA_A / TMA_B (only for operands addressed by schedule position): the expert's full chunks of
    BLOCK_K rows load through a_desc ([S, M], block [BK, BM]) / b_desc ([S, N], block [BK, BN]),
    so no TMA box ever reaches another expert's rows; the last partial chunk takes the masked
    pointer path. Same chunks, same values, same order as without TMA: same bits.
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
        acc = _dot(a, b, acc, INPUT_PRECISION, UPCAST)
    for r0 in range(full_end, row_end, BLOCK_K):  # every chunk without TMA; the partial tail with it
        positions = (r0 + tl.arange(0, BLOCK_K)).to(tl.int64)
        mask_r = positions < row_end
        rows_a = _weight_grad_rows(A_ROWS, positions, sorted_slots_ptr, mask_r, TOP_K)
        rows_b = _weight_grad_rows(B_ROWS, positions, sorted_slots_ptr, mask_r, TOP_K)
        a = tl.load(a_ptr + rows_a[None, :] * stride_ar + offs_m[:, None] * stride_ac,
                    mask=mask_m[:, None] & mask_r[None, :], other=0.0)
        b = tl.load(b_ptr + rows_b[:, None] * stride_br + offs_n[None, :] * stride_bc,
                    mask=mask_r[:, None] & mask_n[None, :], other=0.0)
        acc = _dot(a, b, acc, INPUT_PRECISION, UPCAST)
    c_ptrs = c_ptr + expert * stride_ce + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _combine_kernel(y_ptr, weights_ptr, out_ptr, hidden, stride_yn, stride_ot,
                    TOP_K: tl.constexpr, HAS_WEIGHTS: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = round(sum_{k=0..K-1} weight[t, k] * y[t * K + k]) in fp32, k in order.

    Without weights: the plain sum (used for d hidden). One program per (token, column block).
    """
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        y = tl.load(y_ptr + (token * TOP_K + k) * stride_yn + offs_h, mask=mask_h, other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            acc = acc + tl.load(weights_ptr + token * TOP_K + k) * y
        else:
            acc = acc + y
    tl.store(out_ptr + token * stride_ot + offs_h, acc.to(out_ptr.dtype.element_ty), mask=mask_h)


@triton.jit
def _combine_backward_kernel(grad_out_ptr, y_ptr, weights_ptr, grad_y_ptr, grad_weights_ptr, row_of_slot_ptr, hidden,
                             stride_gt, stride_yn, stride_gyn, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
                             ROW_MAP: tl.constexpr):
    """Per token t and k: d weight[t, k] = <d out[t], y[t, k]> (fp32, column blocks in order) and
    d y[t, k] = round(weight[t, k] * d out[t]), stored at row slot (t * K + k) or, with ROW_MAP, at
    row row_of_slot[slot] (its schedule position: d y in schedule order; same values)."""
    token = tl.program_id(0).to(tl.int64)
    for k in tl.static_range(TOP_K):
        slot = token * TOP_K + k
        if ROW_MAP:
            grad_row = tl.load(row_of_slot_ptr + slot).to(tl.int64)
        else:
            grad_row = slot
        weight = tl.load(weights_ptr + slot)
        dot = tl.zeros([], dtype=tl.float32)
        for h0 in range(0, hidden, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            mask_h = offs_h < hidden
            grad = tl.load(grad_out_ptr + token * stride_gt + offs_h, mask=mask_h, other=0.0).to(tl.float32)
            y = tl.load(y_ptr + slot * stride_yn + offs_h, mask=mask_h, other=0.0).to(tl.float32)
            dot = dot + tl.sum(grad * y, axis=0)
            tl.store(grad_y_ptr + grad_row * stride_gyn + offs_h, (weight * grad).to(grad_y_ptr.dtype.element_ty), mask=mask_h)
        tl.store(grad_weights_ptr + slot, dot)


# ============================================================================================
# configs: one place, chosen from shapes (never autotuned). BLOCK_K is the same everywhere.
# ============================================================================================

BLOCK_K = 64  # the default reduction step; a config may set its own (bits do not depend on it: tests)
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

try:  # host-side TMA descriptors (Triton >= 3.4); without them every kernel uses pointer loads
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

# Keyed by the size class of the average rows per active expert (see _size_class). Keys of a
# GEMM entry: BLOCK_M, BLOCK_N, GROUP_M (row tiles per column sweep), num_warps, num_stages, and
# optionally BLOCK_K (default BLOCK_K) and TMA (1: weight tiles, and A tiles whose rows are
# contiguous, through TMA descriptors where the layout allows; default 0). weight_grad: BLOCK_M,
# BLOCK_N, num_warps, num_stages, optionally BLOCK_K (rows per step) and TMA (full row chunks of
# operands in schedule order). Backward layout flags (default 0, see backward_stages): SORTED_DY
# in bwd_act or weight_grad, SORTED_X in weight_grad. Tuned by bench/moe_sweep.py,
# which checks that every candidate gives the default's bits.
CONFIGS: dict[str, dict[str, dict[str, int]]] = {
    # decode / tiny batches: memory-bound on the weights; many narrow column tiles keep SMs busy.
    "decode": {
        "gemm1": dict(BLOCK_M=16, BLOCK_N=32, GROUP_M=1, num_warps=4, num_stages=4),
        "gemm2": dict(BLOCK_M=16, BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=4),
        "bwd_act": dict(BLOCK_M=16, BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=4),
        "bwd_dx": dict(BLOCK_M=16, BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=4),
        "weight_grad": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    },
    "small": {
        "gemm1": dict(BLOCK_M=64, BLOCK_N=64, GROUP_M=4, num_warps=4, num_stages=4),
        "gemm2": dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=4, num_warps=4, num_stages=4),
        "bwd_act": dict(BLOCK_M=64, BLOCK_N=64, GROUP_M=4, num_warps=4, num_stages=4),
        "bwd_dx": dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=4, num_warps=4, num_stages=4),
        "weight_grad": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3),
    },
    # 256 < rows per expert <= 2048 (qwen3, olmoe, deepseek-v3 at T = 16384). Chosen by bench/moe_sweep.py
    # on the H200 (2026-11-30): forward kernels from bench/results/moe-sweep-h200-2026-11-30.jsonl, backward
    # kernels from bench/results/moe-sweep-bwd-h200-2026-11-30.jsonl (deepseek-v3); every candidate was
    # bitwise identical to the previous configs.
    "large": {
        "gemm1": dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, TMA=1, num_warps=8, num_stages=4),
        "gemm2": dict(BLOCK_M=128, BLOCK_N=256, GROUP_M=8, TMA=1, num_warps=8, num_stages=3),
        # the SwiGLU-backward epilogue holds gate and up tiles beside the accumulator: narrower tiles
        "bwd_act": dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, SORTED_DY=1, TMA=1, num_stages=4, num_warps=8),
        "bwd_dx": dict(BLOCK_M=128, BLOCK_N=256, GROUP_M=8, num_stages=4, num_warps=8),
        "weight_grad": dict(BLOCK_M=128, BLOCK_N=256, SORTED_DY=1, SORTED_X=1, TMA=1, num_stages=3, num_warps=8),
    },
    # more than 2048 rows per expert (mixtral at T = 16384): few experts, long GEMMs (same sweep)
    "xlarge": {
        "gemm1": dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, TMA=1, num_warps=8, num_stages=4),
        "gemm2": dict(BLOCK_M=128, BLOCK_N=256, GROUP_M=8, TMA=1, num_warps=8, num_stages=4),
        "bwd_act": dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, SORTED_DY=1, TMA=1, num_stages=4, num_warps=8),
        "bwd_dx": dict(BLOCK_M=128, BLOCK_N=256, GROUP_M=16, TMA=1, num_stages=3, num_warps=8),
        "weight_grad": dict(BLOCK_M=128, BLOCK_N=256, SORTED_DY=1, SORTED_X=1, TMA=1, num_stages=3, num_warps=8),
    },
}
COMBINE_BLOCK_H = 1024
# Up to this many slots the schedule and its tiles come from one Triton program (_schedule_kernel);
# above, from torch ops (sort + searchsorted: launch cost no longer matters). 0 disables the kernel.
SCHEDULE_KERNEL_MAX_SLOTS = 2048
SCHEDULE_KERNEL_MAX_EXPERTS = 512


def _size_class(num_slots: int, num_experts: int) -> str:
    rows_per_expert = num_slots / max(1, min(num_experts, num_slots))
    if rows_per_expert <= 16:
        return "decode"
    if rows_per_expert <= 256:
        return "small"
    if rows_per_expert <= 2048:
        return "large"
    return "xlarge"


def pick_configs(num_slots: int, num_experts: int, override: dict | None = None) -> dict[str, dict[str, int]]:
    """The config of each kernel for this problem size; `override` (tests) replaces whole entries."""
    configs = dict(CONFIGS[_size_class(num_slots, num_experts)])
    if override:
        configs.update(override)
    return configs


# ============================================================================================
# launchers
# ============================================================================================


def _input_precision(dtype: torch.dtype) -> str:
    # bf16/fp16 operands go to the tensor cores as they are; fp32 operands must not use TF32.
    return "ieee"


def _split_config(config: dict) -> tuple[int, int, int, int, bool, dict]:
    """-> (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, TMA, launch options (num_warps, num_stages))."""
    cfg = dict(config)
    block_m, block_n = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
    block_k = cfg.pop("BLOCK_K", BLOCK_K)
    group_m = cfg.pop("GROUP_M", 1)
    tma = bool(cfg.pop("TMA", 0))
    return block_m, block_n, block_k, group_m, tma, cfg


_BACKWARD_LAYOUT_FLAGS = ("SORTED_DY", "SORTED_X")  # moe_backward's data layout, not launch options


def _gemm_config(config: dict) -> dict:
    return {key: value for key, value in config.items() if key not in _BACKWARD_LAYOUT_FLAGS}


def _tma_ok(t: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned base and row strides; 16-bit dtypes only (fp32 stays on pointers)."""
    return (TensorDescriptor is not None and t.dtype in (torch.bfloat16, torch.float16) and t.is_contiguous()
            and t.numel() > 0 and t.data_ptr() % 16 == 0
            and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1]))


def _descriptor(t2d: torch.Tensor, block_shape: list[int]):
    rows, cols = t2d.shape
    return TensorDescriptor(t2d, [rows, cols], [cols, 1], block_shape)


class Schedule:
    """Slots grouped by expert (stable) and the row tiles of one BLOCK_M, all on the device (no sync).

    sorted_slots int32 [S]; expert_start int32 [E + 1]; per row tile: expert and first schedule
    position (int32 [max_tiles]); num_tiles int32 [1] (the valid prefix of the tile arrays).
    Small batches (<= SCHEDULE_KERNEL_MAX_SLOTS slots) build all of it in one kernel launch per
    BLOCK_M (`block_m`: the first tiles to build with the schedule); the torch path gives the same
    integers.
    """

    def __init__(self, ids_TK: torch.Tensor, num_experts: int, sorted_slots_S: torch.Tensor | None = None,
                 expert_start: torch.Tensor | None = None, block_m: int | None = None):
        self.num_slots = ids_TK.numel()
        self.num_experts = num_experts
        device = ids_TK.device
        self._tiles: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = {}
        self._use_kernel = 0 < self.num_slots <= SCHEDULE_KERNEL_MAX_SLOTS and num_experts <= SCHEDULE_KERNEL_MAX_EXPERTS
        if sorted_slots_S is None:
            if self._use_kernel and block_m is not None:
                self.sorted_slots = torch.empty(self.num_slots, device=device, dtype=torch.int32)
                self.expert_start = torch.empty(num_experts + 1, device=device, dtype=torch.int32)
                self._launch(block_m, ids_TK.reshape(-1).to(torch.int32))
                return
            sorted_ids_S, sorted_slots_S = torch.sort(ids_TK.reshape(-1).to(torch.int32), stable=True)
            expert_start = torch.searchsorted(
                sorted_ids_S, torch.arange(num_experts + 1, device=device, dtype=torch.int32), out_int32=True)
        self.sorted_slots = sorted_slots_S.to(torch.int32)
        self.expert_start = expert_start.to(torch.int32)

    def _max_tiles(self, block_m: int) -> int:
        # Each non-empty expert wastes less than one tile: an upper bound that needs no sync.
        return max(1, triton.cdiv(self.num_slots, block_m) + min(self.num_experts, self.num_slots))

    def _launch(self, block_m: int, ids_S: torch.Tensor | None) -> None:
        """_schedule_kernel: sort (ids_S given) and the tiles of block_m, or the tiles alone."""
        device = self.expert_start.device
        max_tiles = self._max_tiles(block_m)
        tile_expert = torch.empty(max_tiles, device=device, dtype=torch.int32)
        tile_row_start = torch.empty(max_tiles, device=device, dtype=torch.int32)
        num_tiles = torch.empty(1, device=device, dtype=torch.int32)
        block_e = max(16, triton.next_power_of_2(self.num_experts))
        _schedule_kernel[(1,)](
            ids_S if ids_S is not None else self.expert_start, self.sorted_slots, self.expert_start,
            tile_expert, tile_row_start, num_tiles, self.num_slots, self.num_experts, max_tiles,
            SORT=ids_S is not None, BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=32 if block_e >= 256 else 64,
            num_warps=4)
        self._tiles[block_m] = (tile_expert, tile_row_start, num_tiles, max_tiles)

    def tiles(self, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        if block_m not in self._tiles and self._use_kernel:
            self._launch(block_m, None)
        if block_m not in self._tiles:
            device = self.expert_start.device
            start = self.expert_start.long()
            counts = start[1:] - start[:-1]
            tiles_per_expert = (counts + block_m - 1) // block_m
            tile_end = torch.cumsum(tiles_per_expert, 0)
            max_tiles = self._max_tiles(block_m)
            tile_ids = torch.arange(max_tiles, device=device)
            expert = torch.searchsorted(tile_end, tile_ids, right=True).clamp_(max=self.num_experts - 1)
            first_tile = tile_end[expert] - tiles_per_expert[expert]
            row_start = start[expert] + (tile_ids - first_tile) * block_m
            num_tiles = tile_end[-1:].to(torch.int32)
            self._tiles[block_m] = (expert.to(torch.int32), row_start.to(torch.int32), num_tiles, max_tiles)
        return self._tiles[block_m]


def launch_route(logits_TE: torch.Tensor, top_k: int, renormalize: bool, ids_TK: torch.Tensor | None = None):
    num_tokens, num_experts = logits_TE.shape
    device = logits_TE.device
    replay = ids_TK is not None
    if not replay:
        ids_TK = torch.empty(num_tokens, top_k, device=device, dtype=torch.int32)
    weights_TK = torch.empty(num_tokens, top_k, device=device, dtype=torch.float32)
    probs_TE = torch.empty(num_tokens, num_experts, device=device, dtype=torch.float32)
    if num_tokens:
        block_e = triton.next_power_of_2(num_experts)
        _route_kernel[(num_tokens,)](
            logits_TE, ids_TK, weights_TK, probs_TE, num_experts, logits_TE.stride(0),
            TOP_K=top_k, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
            RENORMALIZE=renormalize, REPLAY=replay, num_warps=4 if block_e >= 256 else 1)
    return ids_TK, weights_TK, probs_TE


def launch_gemm1(x_TH, w13_E2IH, schedule: Schedule, top_k: int, save_gate_up: bool, config: dict):
    num_slots = schedule.num_slots
    num_experts, two_inter, hidden = w13_E2IH.shape
    inter = two_inter // 2
    act_SI = torch.empty(num_slots, inter, device=x_TH.device, dtype=x_TH.dtype)
    gate_up_S2I = torch.empty(num_slots if save_gate_up else 0, 2 * inter, device=x_TH.device, dtype=x_TH.dtype)
    block_m, block_n, block_k, group_m, tma, cfg = _split_config(config)
    tma_b = tma and _tma_ok(w13_E2IH)
    w13_desc = _descriptor(w13_E2IH.view(num_experts * two_inter, hidden), [block_n, block_k]) if tma_b else w13_E2IH
    tile_expert, tile_row_start, num_tiles, max_tiles = schedule.tiles(block_m)
    grid = (max_tiles * triton.cdiv(inter, block_n),)
    _gemm1_swiglu_kernel[grid](
        x_TH, w13_E2IH, w13_desc, gate_up_S2I if save_gate_up else act_SI, act_SI,
        schedule.sorted_slots, schedule.expert_start, tile_expert, tile_row_start, num_tiles,
        max_tiles, inter, hidden,
        x_TH.stride(0), x_TH.stride(1), w13_E2IH.stride(0), w13_E2IH.stride(1), w13_E2IH.stride(2),
        TOP_K=top_k, SAVE_GATE_UP=save_gate_up, INPUT_PRECISION=_input_precision(x_TH.dtype), UPCAST=_INTERPRET,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, TMA_B=tma_b, **cfg)
    return gate_up_S2I, act_SI


def launch_grouped_gemm(a, b_E, b_strides, c, n_cols, k_dim, schedule: Schedule, top_k: int, config: dict, *,
                        a_rows: int, c_rows: int, gate_up=None):
    """c[rows] = a[rows] @ B[e], B[e][k, n] at b_E + e * stride_e + k * stride_k + n * stride_n.

    With gate_up given, c is d gate_up [S, 2I] and the kernel runs the SwiGLU backward epilogue.
    b_E is a weight tensor [E, R, C]; with TMA in the config, B tiles come through a descriptor
    when B[e] is b_E[e] ([K, N], needs BLOCK_K | K) or its transpose ([N, K]).
    """
    block_m, block_n, block_k, group_m, tma, cfg = _split_config(config)
    tile_expert, tile_row_start, num_tiles, max_tiles = schedule.tiles(block_m)
    stride_e, stride_k, stride_n = b_strides
    tma_a = tma and a_rows == 0 and _tma_ok(a) and a.shape[1] == k_dim
    a_desc = _descriptor(a, [block_m, block_k]) if tma_a else a
    tma_b, b_desc = 0, b_E
    if tma and b_E.dim() == 3 and _tma_ok(b_E):
        num_experts, rows, cols = b_E.shape
        flat = b_E.view(num_experts * rows, cols)
        if stride_k == 1 and (rows, cols) == (n_cols, k_dim):
            tma_b, b_desc = 1, _descriptor(flat, [block_n, block_k])
        elif stride_n == 1 and (rows, cols) == (k_dim, n_cols) and k_dim % block_k == 0:
            tma_b, b_desc = 2, _descriptor(flat, [block_k, block_n])
    grid = (max_tiles * triton.cdiv(n_cols, block_n),)
    _grouped_gemm_kernel[grid](
        a, a_desc, b_E, b_desc, c, gate_up if gate_up is not None else c,
        schedule.sorted_slots, schedule.expert_start, tile_expert, tile_row_start, num_tiles,
        max_tiles, n_cols, k_dim,
        a.stride(0), a.stride(1), stride_e, stride_k, stride_n, c.stride(0), c.stride(1),
        A_ROWS=a_rows, C_ROWS=c_rows, SWIGLU_BACKWARD=gate_up is not None,
        TOP_K=top_k, INPUT_PRECISION=_input_precision(a.dtype), UPCAST=_INTERPRET,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, TMA_A=tma_a, TMA_B=tma_b, **cfg)


def launch_weight_grad(a, b, out_EMN, schedule: Schedule, top_k: int, config: dict, *, a_rows: int, b_rows: int):
    """out[e] = A_e^T @ B_e over expert e's rows, A: [rows, M], B: [rows, N], out: [E, M, N].

    With TMA in the config, an operand addressed by schedule position (rows 0) loads its full row
    chunks through a descriptor (contiguous 16-bit tensors with 16-byte aligned rows only).
    """
    num_experts, m_dim, n_dim = out_EMN.shape
    block_m, block_n, block_k, _, tma, cfg = _split_config(config)
    for flag in _BACKWARD_LAYOUT_FLAGS:
        cfg.pop(flag, None)
    tma_a = tma and a_rows == 0 and _tma_ok(a) and a.shape[1] == m_dim
    tma_b = tma and b_rows == 0 and _tma_ok(b) and b.shape[1] == n_dim
    a_desc = _descriptor(a, [block_k, block_m]) if tma_a else a
    b_desc = _descriptor(b, [block_k, block_n]) if tma_b else b
    grid = (triton.cdiv(m_dim, block_m) * triton.cdiv(n_dim, block_n), num_experts)
    _weight_grad_kernel[grid](
        a, a_desc, b, b_desc, out_EMN, schedule.sorted_slots, schedule.expert_start,
        m_dim, n_dim, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        out_EMN.stride(0), out_EMN.stride(1), out_EMN.stride(2),
        A_ROWS=a_rows, B_ROWS=b_rows, TOP_K=top_k, INPUT_PRECISION=_input_precision(a.dtype), UPCAST=_INTERPRET,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, TMA_A=tma_a, TMA_B=tma_b, **cfg)


def launch_combine(y_NH, weights_TK, out_TH, top_k: int):
    num_tokens, hidden = out_TH.shape
    if num_tokens == 0:
        return out_TH
    block_h = min(COMBINE_BLOCK_H, triton.next_power_of_2(hidden))
    grid = (num_tokens, triton.cdiv(hidden, block_h))
    _combine_kernel[grid](
        y_NH, weights_TK if weights_TK is not None else y_NH, out_TH, hidden, y_NH.stride(0), out_TH.stride(0),
        TOP_K=top_k, HAS_WEIGHTS=weights_TK is not None, BLOCK_H=block_h, num_warps=4)
    return out_TH


def launch_combine_backward(grad_out_TH, y_NH, weights_TK, top_k: int, row_of_slot_N: torch.Tensor | None = None):
    """-> (d y [N, H] in slot order, or in schedule order when row_of_slot (int32 [N]) is given;
    d topk_weights fp32 [T, K])."""
    num_tokens, hidden = grad_out_TH.shape
    grad_y_NH = torch.empty_like(y_NH)
    grad_weights_TK = torch.empty(num_tokens, top_k, device=y_NH.device, dtype=torch.float32)
    if num_tokens:
        block_h = min(COMBINE_BLOCK_H, triton.next_power_of_2(hidden))
        row_map = row_of_slot_N is not None
        _combine_backward_kernel[(num_tokens,)](
            grad_out_TH, y_NH, weights_TK, grad_y_NH, grad_weights_TK, row_of_slot_N if row_map else weights_TK,
            hidden, grad_out_TH.stride(0), y_NH.stride(0), grad_y_NH.stride(0), TOP_K=top_k, BLOCK_H=block_h,
            ROW_MAP=row_map, num_warps=4)
    return grad_y_NH, grad_weights_TK


# ============================================================================================
# adapters (called by mok/ops/*.py on CUDA tensors; by the interpreter tests on CPU tensors)
# ============================================================================================


def route(logits_TE: torch.Tensor, top_k: int, renormalize: bool):
    """-> (topk_ids int32 [T, K], topk_weights fp32 [T, K], probs fp32 [T, E])."""
    return launch_route(logits_TE.contiguous(), top_k, renormalize)


def replay_weights(logits_TE: torch.Tensor, ids_TK: torch.Tensor, renormalize: bool):
    """-> (topk_weights fp32 [T, K], probs fp32 [T, E]) for given ids."""
    _, weights_TK, probs_TE = launch_route(logits_TE.contiguous(), ids_TK.shape[1], renormalize, ids_TK.contiguous())
    return weights_TK, probs_TE


def moe_forward(x_TH, w13_E2IH, w2_EHI, ids_TK, weights_TK, save_for_backward: bool, configs: dict | None = None):
    """Expert computation for given routes; same contract as mok.reference.moe.moe_forward.

    Returns (out [T, H], gate_up [S, 2I], act [S, I], y [N, H], sorted_slots int64 [S],
    expert_start int64 [E + 1]); without save_for_backward the last five are empty.
    `configs` (tests) overrides entries of the chosen config.
    """
    num_tokens, hidden = x_TH.shape
    num_experts, two_inter, _ = w13_E2IH.shape
    top_k = ids_TK.shape[1]
    device, dtype = x_TH.device, x_TH.dtype
    x_TH = x_TH.contiguous()
    weights_TK = weights_TK.float().contiguous()
    cfg = pick_configs(ids_TK.numel(), num_experts, configs)
    schedule = Schedule(ids_TK.contiguous(), num_experts, block_m=cfg["gemm1"]["BLOCK_M"])
    out_TH = torch.empty(num_tokens, hidden, device=device, dtype=dtype)
    y_NH = torch.empty(schedule.num_slots, hidden, device=device, dtype=dtype)
    if num_tokens:
        gate_up_S2I, act_SI = launch_gemm1(x_TH, w13_E2IH, schedule, top_k, save_for_backward, cfg["gemm1"])
        # y[slot] = act @ w2[e]^T: B[e][k=i, n=h] = w2[e, h, i]
        launch_grouped_gemm(act_SI, w2_EHI, (w2_EHI.stride(0), w2_EHI.stride(2), w2_EHI.stride(1)), y_NH,
                            hidden, two_inter // 2, schedule, top_k, cfg["gemm2"], a_rows=0, c_rows=1)
        launch_combine(y_NH, weights_TK, out_TH, top_k)
    else:
        gate_up_S2I = torch.empty(0, two_inter, device=device, dtype=dtype)
        act_SI = torch.empty(0, two_inter // 2, device=device, dtype=dtype)
    if not save_for_backward:
        # Custom-op outputs may not alias each other: one fresh empty tensor each.
        def empty(*shape, dtype=dtype):
            return torch.empty(*shape, device=device, dtype=dtype)

        return (out_TH, empty(0, two_inter), empty(0, two_inter // 2), empty(0, hidden),
                empty(0, dtype=torch.int64), empty(0, dtype=torch.int64))
    return (out_TH, gate_up_S2I, act_SI, y_NH, schedule.sorted_slots.long(), schedule.expert_start.long())


def moe_backward(grad_out_TH, x_TH, w13_E2IH, w2_EHI, ids_TK, weights_TK, gate_up_S2I, act_SI, y_NH,
                 sorted_slots_S, expert_start, configs: dict | None = None):
    """Gradients; same contract as mok.reference.moe.moe_backward:
    (d hidden [T, H], d w13 [E, 2I, H], d w2 [E, H, I], d topk_weights fp32 [T, K])."""
    stages, result = backward_stages(grad_out_TH, x_TH, w13_E2IH, w2_EHI, ids_TK, weights_TK, gate_up_S2I, act_SI,
                                     y_NH, sorted_slots_S, expert_start, configs)
    for _, run in stages:
        run()
    return result()


def backward_stages(grad_out_TH, x_TH, w13_E2IH, w2_EHI, ids_TK, weights_TK, gate_up_S2I, act_SI, y_NH,
                    sorted_slots_S, expert_start, configs: dict | None = None):
    """moe_backward as named stages -> ([(name, run)], result): running every stage once, in order,
    then result() gives moe_backward's tuple. Each stage only reads what earlier stages wrote, so
    bench/moe_sweep.py may rerun one alone to time it.

    Layout flags (optional keys of the kernel configs, default 0; values are the same either way):
    SORTED_DY (bwd_act or weight_grad): d y is stored in schedule order (its rows are contiguous per
    expert: TMA-able A rows of bwd_act and d w2); SORTED_X (weight_grad): x is gathered once into
    schedule order for d w13 (a copy of S * H elements, so its rows are contiguous too).
    """
    num_tokens, hidden = x_TH.shape
    num_experts, two_inter, _ = w13_E2IH.shape
    inter = two_inter // 2
    top_k = ids_TK.shape[1]
    device, dtype = x_TH.device, x_TH.dtype
    schedule = Schedule(ids_TK, num_experts, sorted_slots_S, expert_start)
    cfg = pick_configs(schedule.num_slots, num_experts, configs)
    grad_out_TH = grad_out_TH.to(dtype).contiguous()
    weights_TK = weights_TK.float().contiguous()
    x_TH = x_TH.contiguous()
    grad_w13 = torch.empty_like(w13_E2IH)
    grad_w2 = torch.empty_like(w2_EHI)
    grad_hidden_TH = torch.empty_like(x_TH)
    if num_tokens == 0:
        def zero():
            grad_w13.zero_()
            grad_w2.zero_()

        empty_weights = torch.zeros(0, top_k, device=device, dtype=torch.float32)
        return [("zero", zero)], lambda: (grad_hidden_TH, grad_w13, grad_w2, empty_weights)
    sorted_dy = bool(cfg["bwd_act"].get("SORTED_DY", 0) or cfg["weight_grad"].get("SORTED_DY", 0))
    sorted_x = bool(cfg["weight_grad"].get("SORTED_X", 0))
    dy_rows = 0 if sorted_dy else 1  # how a schedule position addresses d y
    state: dict[str, torch.Tensor] = {}
    stages = []
    if sorted_dy:
        def row_of_slot():
            # the inverse permutation of sorted_slots: integer scatter of distinct indices (deterministic)
            rows = torch.empty(schedule.num_slots, device=device, dtype=torch.int32)
            rows[schedule.sorted_slots.long()] = torch.arange(schedule.num_slots, device=device, dtype=torch.int32)
            state["row_of_slot"] = rows

        stages.append(("row_of_slot", row_of_slot))

    def combine_backward():
        state["grad_y"], state["grad_weights"] = launch_combine_backward(
            grad_out_TH, y_NH, weights_TK, top_k, state.get("row_of_slot"))

    def bwd_act():
        # d gate_up[p] = swiglu'(d act), d act[p] = d y[p or slot(p)] @ w2[e]: B[e][k=h, n=i] = w2[e, h, i]
        state["grad_gate_up"] = torch.empty(schedule.num_slots, two_inter, device=device, dtype=dtype)
        launch_grouped_gemm(state["grad_y"], w2_EHI, (w2_EHI.stride(0), w2_EHI.stride(1), w2_EHI.stride(2)),
                            state["grad_gate_up"], inter, hidden, schedule, top_k, _gemm_config(cfg["bwd_act"]),
                            a_rows=dy_rows, c_rows=0, gate_up=gate_up_S2I)

    def bwd_dx():
        # d hidden per slot (fp32) = d gate_up[p] @ w13[e]: B[e][k=j, n=h] = w13[e, j, h]
        state["grad_hidden_N"] = torch.empty(schedule.num_slots, hidden, device=device, dtype=torch.float32)
        launch_grouped_gemm(state["grad_gate_up"], w13_E2IH,
                            (w13_E2IH.stride(0), w13_E2IH.stride(1), w13_E2IH.stride(2)),
                            state["grad_hidden_N"], hidden, two_inter, schedule, top_k, _gemm_config(cfg["bwd_dx"]),
                            a_rows=0, c_rows=1)

    def combine_dx():
        launch_combine(state["grad_hidden_N"], None, grad_hidden_TH, top_k)

    def weight_grad_w2():
        # d w2[e] = d y_e^T @ act_e (rows in schedule order)
        launch_weight_grad(state["grad_y"], act_SI, grad_w2, schedule, top_k, cfg["weight_grad"],
                           a_rows=dy_rows, b_rows=0)

    def gather_x():
        state["x_S"] = x_TH.index_select(0, schedule.sorted_slots.long() // top_k)

    def weight_grad_w13():
        # d w13[e] = d gate_up_e^T @ x_e (rows in schedule order)
        x_rows = state.get("x_S")
        launch_weight_grad(state["grad_gate_up"], x_rows if x_rows is not None else x_TH, grad_w13, schedule, top_k,
                           cfg["weight_grad"], a_rows=0, b_rows=0 if x_rows is not None else 2)

    stages += [("combine_backward", combine_backward), ("bwd_act", bwd_act), ("bwd_dx", bwd_dx),
               ("combine_dx", combine_dx), ("weight_grad_w2", weight_grad_w2)]
    if sorted_x:
        stages.append(("gather_x", gather_x))
    stages.append(("weight_grad_w13", weight_grad_w13))
    return stages, lambda: (grad_hidden_TH, grad_w13, grad_w2, state["grad_weights"])
