"""The grouped GEMMs of the MoE layer: GEMM 1 + SwiGLU, the grouped GEMM of GEMM 2 and the backward
(d act with the SwiGLU backward, d hidden), the weight gradients, and their launchers.

Shapes: docs/shapes.md. Kernel rules (sequential unsplit K loop, fp32 accumulator, no TF32, no float
atomics, tile-shape invariance measured on the H200): docs/kernels.md. Every GEMM walks its reduction
dimension in one sequential loop of BLOCK_K steps with an fp32 accumulator, so a row's bits do not
depend on BLOCK_M/BLOCK_N/BLOCK_K, warps or stages (tests/mok/test_moe_gpu.py re-proves it per kernel).
Row tiles come from the schedule (schedule.py): a tile holds BLOCK_M consecutive schedule positions
of one expert. TMA descriptors (configs with TMA=1) only change how tiles are loaded: same tiles,
same values, same order, same bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok.kernels.launch import INTERPRET, cached_launch, pdl_options, wait_for_predecessor
from mok.kernels.moe.configs import split_config
from mok.kernels.moe.routing import route_blocks, route_token
from mok.kernels.moe.schedule import ScannedRoutes, Schedule, valid_ids

try:  # host-side TMA descriptors (Triton >= 3.4); without them every kernel uses pointer loads
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

# How a schedule position p addresses an operand's rows (the A_ROWS / B_ROWS / C_ROWS constexprs).
ROWS_POSITION = tl.constexpr(0)  # row p: the operand is in schedule order
ROWS_SLOT = tl.constexpr(1)  # row sorted_slots_N[p]: the operand is in slot order
ROWS_TOKEN = tl.constexpr(2)  # row sorted_slots_N[p] // K: one row per token (x_TH)

# How the grouped GEMM loads B[e] (the TMA_B constexpr of _grouped_gemm_kernel).
TMA_B_OFF = tl.constexpr(0)  # pointer loads
TMA_B_NK = tl.constexpr(1)  # B[e] stored [n, k] (k contiguous): descriptor [E * n, k], block [BLOCK_N, BLOCK_K]
TMA_B_KN = tl.constexpr(2)  # B[e] stored [k, n] (n contiguous): descriptor [E * k, n], block [BLOCK_K, BLOCK_N]


# ============================================================================================
# kernels
# ============================================================================================


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b with an fp32 accumulator; input_precision="ieee": bf16/fp16 operands go to the
    tensor cores as they are, fp32 operands never use TF32. UPCAST (interpreter only: its tl.dot
    multiplies the raw storage bits of bf16 operands) feeds exact fp32 copies instead; never set on a GPU."""
    if UPCAST:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    return acc


@triton.jit
def _tile_rows(tile_expert_ptr, tile_row_start_ptr, expert_start_ptr, sorted_slots_ptr, pid_m,
               TOP_K: tl.constexpr, BLOCK_M: tl.constexpr):
    """Rows of row-tile pid_m: (expert, first position, schedule positions [BLOCK_M], row mask,
    slots [BLOCK_M], tokens [BLOCK_M])."""
    expert = tl.load(tile_expert_ptr + pid_m)
    row_start = tl.load(tile_row_start_ptr + pid_m)
    row_end = tl.load(expert_start_ptr + expert + 1)
    positions = (row_start + tl.arange(0, BLOCK_M)).to(tl.int64)
    mask_m = positions < row_end
    slots = tl.load(sorted_slots_ptr + positions, mask=mask_m, other=0).to(tl.int64)
    return expert.to(tl.int64), row_start, positions, mask_m, slots, slots // TOP_K


@triton.jit
def _scanned_tile_rows(ids_ptr, num_slots, num_experts, slot, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_KP: tl.constexpr, BLOCK_M: tl.constexpr):
    """The row tile of `slot` without a schedule (ScannedRoutes), from the ids at ids_ptr through valid_ids, as the
    schedule reads them: _tile_of_slot's tuple."""
    experts_TK = valid_ids(ids_ptr, tl.arange(0, BLOCK_T), num_slots // TOP_K, num_experts, TOP_K, BLOCK_KP)
    return _tile_of_slot(experts_TK, slot, TOP_K, BLOCK_T, BLOCK_KP, BLOCK_M)


@triton.jit
def _tile_of_slot(experts_TK, slot, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_KP: tl.constexpr,
                  BLOCK_M: tl.constexpr):
    """The row tile of `slot` from the experts [BLOCK_T, BLOCK_KP] of every slot (E where masked, never a hit):
    (expert, rows [BLOCK_M] (slots: rows are in slot order), row mask, slots, tokens, leads). The slot leads when
    its rank among its expert's slots (slot order) is a multiple of BLOCK_M; the tile is then that expert's next
    BLOCK_M slots, the rows the schedule's tile holds. leads: int32 0/1."""
    offs_t = tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_KP)
    slots_TK = offs_t[:, None] * TOP_K + offs_k[None, :]
    mine_TK = (slots_TK == slot) & (offs_k < TOP_K)[None, :]
    expert = tl.sum(tl.sum(tl.where(mine_TK, experts_TK, 0), axis=1), axis=0)
    hit_TK = (experts_TK == expert).to(tl.int32)
    per_token = tl.sum(hit_TK, axis=1)
    rank_TK = (tl.cumsum(per_token, 0) - per_token)[:, None] + tl.cumsum(hit_TK, axis=1) - hit_TK
    first = tl.sum(tl.sum(tl.where(mine_TK, rank_TK, 0), axis=1), axis=0)
    hit_S = tl.reshape(hit_TK, [BLOCK_T * BLOCK_KP])
    rank_S = tl.reshape(rank_TK, [BLOCK_T * BLOCK_KP])
    slots_S = tl.reshape(slots_TK, [BLOCK_T * BLOCK_KP])
    rows_M = first + tl.arange(0, BLOCK_M)
    take_MS = (rank_S[None, :] == rows_M[:, None]) & (hit_S[None, :] > 0)
    slots = tl.sum(tl.where(take_MS, slots_S[None, :], 0), axis=1).to(tl.int64)
    mask_m = tl.sum(take_MS.to(tl.int32), axis=1) > 0
    return expert.to(tl.int64), slots, mask_m, slots, slots // TOP_K, (first % BLOCK_M == 0).to(tl.int32)


@triton.jit
def _route_tokens(logits_ptr, ids_ptr, weights_ptr, num_tokens, num_experts, stride_logits, store,
                  TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_KP: tl.constexpr, BLOCK_E: tl.constexpr,
                  RENORMALIZE: tl.constexpr):
    """Routing inside GEMM 1 (ROUTE): route_token (routing.py, the routing kernel's code and bits) for each of the
    num_tokens tokens, in every program, since each needs every id to find its rows. Where `store` (one program),
    the ids and weights go to ids_ptr / weights_ptr [T, K] for GEMM 2 and the combine.
    -> experts [BLOCK_T, BLOCK_KP] as valid_ids gives them (E where masked)."""
    offs_t = tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_KP)
    mask_k = offs_k < TOP_K
    store_k = mask_k & ((offs_k * 0 + store.to(tl.int32)) != 0)
    experts_TK = tl.zeros([BLOCK_T, BLOCK_KP], dtype=tl.int32) + num_experts
    for token in range(num_tokens):
        _, weights, ids = route_token(logits_ptr + token * stride_logits, ids_ptr, num_experts, TOP_K, BLOCK_E,
                                      BLOCK_KP, RENORMALIZE, False)
        tl.store(weights_ptr + token * TOP_K + offs_k, weights, mask=store_k)
        tl.store(ids_ptr + token * TOP_K + offs_k, ids, mask=store_k)
        experts_TK = tl.where((offs_t[:, None] == token) & mask_k[None, :], ids[None, :], experts_TK)
    return experts_TK


@triton.jit
def _gemm_rows(ids_ptr, sorted_slots_ptr, expert_start_ptr, tile_expert_ptr, tile_row_start_ptr, num_tiles_ptr,
               max_tiles, num_experts, pid_m, SCANNED: tl.constexpr, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr,
               BLOCK_KP: tl.constexpr, BLOCK_M: tl.constexpr):
    """Row tile pid_m of a GEMM: (runs (int32 0/1), expert, first position, positions [BLOCK_M], row mask, slots,
    tokens), from the schedule's tiles or, SCANNED, from the ids (pid_m is then a slot and max_tiles the slot
    count; positions are slots)."""
    if SCANNED:
        expert, positions, mask_m, slots, tokens, runs = _scanned_tile_rows(
            ids_ptr, max_tiles, num_experts, pid_m, TOP_K, BLOCK_T, BLOCK_KP, BLOCK_M)
        row_start = pid_m * 0
    else:
        runs = (pid_m < tl.load(num_tiles_ptr)).to(tl.int32)
        expert, row_start, positions, mask_m, slots, tokens = _tile_rows(
            tile_expert_ptr, tile_row_start_ptr, expert_start_ptr, sorted_slots_ptr, pid_m, TOP_K, BLOCK_M)
    return runs, expert, row_start, positions, mask_m, slots, tokens


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
def _swizzle(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Group GROUP_M row tiles per column sweep (L2 reuse of the weight tiles)."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@cached_launch
@triton.jit
def _gemm1_swiglu_kernel(
    x_ptr, w13_ptr, w13_desc, gate_up_ptr, act_ptr, logits_ptr, weights_ptr,
    ids_ptr, sorted_slots_ptr, expert_start_ptr, tile_expert_ptr, tile_row_start_ptr, num_tiles_ptr,
    max_tiles, num_experts, inter, hidden,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wk, stride_logits,
    TOP_K: tl.constexpr, SAVE_GATE_UP: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, TMA_B: tl.constexpr,
    SCANNED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_KP: tl.constexpr, PDL: tl.constexpr,
    ROUTE: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """gate_up = x[token] @ w13[e]^T (gathered rows), act = silu(gate) * up, per schedule row.

    Output column block n covers gate columns n and up columns I + n (two accumulators), so the
    SwiGLU epilogue has both halves. gate/up are rounded to the activation dtype first (saved for
    the backward), then act = round(silu(gate) * up) in fp32.
    TMA_B: the weight tiles come through w13_desc (2-D [E * 2I, H], block [BLOCK_N, BLOCK_K]); rows
    past a half's end belong to other columns and only reach masked outputs; columns past H are zeros.
    PDL: launched with programmatic dependent launch (mok/kernels/launch.py).
    ROUTE (with SCANNED: a small decode batch given its router logits [T, E] at logits_ptr): every program routes
    every token itself (_route_tokens: the routing kernel's code, so its bits) instead of a routing launch before
    it, and program 0 stores the ids (at ids_ptr) and the weights (weights_ptr) that GEMM 2 and the combine read.
    """
    wait_for_predecessor(PDL)
    pid_m, pid_n = _swizzle(tl.program_id(0), max_tiles, tl.cdiv(inter, BLOCK_N), GROUP_M)
    if ROUTE:
        experts_TK = _route_tokens(logits_ptr, ids_ptr, weights_ptr, max_tiles // TOP_K, num_experts, stride_logits,
                                   tl.program_id(0) == 0, TOP_K, BLOCK_T, BLOCK_KP, BLOCK_E, RENORMALIZE)
        expert, positions, mask_m, slots, tokens, runs = _tile_of_slot(
            experts_TK, pid_m, TOP_K, BLOCK_T, BLOCK_KP, BLOCK_M)
    else:
        runs, expert, row_start, positions, mask_m, slots, tokens = _gemm_rows(
            ids_ptr, sorted_slots_ptr, expert_start_ptr, tile_expert_ptr, tile_row_start_ptr, num_tiles_ptr,
            max_tiles, num_experts, pid_m, SCANNED, TOP_K, BLOCK_T, BLOCK_KP, BLOCK_M)
    if runs == 0:
        return
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
        acc_gate = _dot(a, wg, acc_gate, UPCAST)
        acc_up = _dot(a, wu, acc_up, UPCAST)
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
    act_ptrs = act_ptr + positions[:, None] * inter + offs_n[None, :]
    tl.store(act_ptrs, act.to(out_dtype), mask=mask_mn)


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


# ============================================================================================
# launchers
# ============================================================================================


def _tma_ok(t: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned base and row strides; 16-bit dtypes only (fp32 stays on pointers)."""
    return (TensorDescriptor is not None and t.dtype in (torch.bfloat16, torch.float16) and t.is_contiguous()
            and t.numel() > 0 and t.data_ptr() % 16 == 0
            and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1]))


def _descriptor(t2d: torch.Tensor, block_shape: list[int]):
    rows, cols = t2d.shape
    return TensorDescriptor(t2d, [rows, cols], [cols, 1], block_shape)


def launch_gemm1(x_TH: torch.Tensor, w13_E2IH: torch.Tensor, schedule: Schedule | ScannedRoutes, top_k: int,
                 save_gate_up: bool, config: dict, act_NI: torch.Tensor | None = None,
                 route: tuple[torch.Tensor, torch.Tensor, bool] | None = None
                 ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """-> (gate_up_N2I, act_NI), rows in schedule order (slot order with ScannedRoutes); gate_up_N2I has no
    rows unless save_gate_up.
    act_NI: a contiguous [N, I] buffer to write instead of a fresh one; then without save_gate_up no
    gate_up tensor is made (None comes back).
    route (with ScannedRoutes): (logits fp32 [T, E] contiguous, weights fp32 [T, K] contiguous, renormalize): GEMM 1
    routes the tokens itself (the kernel's ROUTE) and writes their ids into the ScannedRoutes' ids (int32 [T, K])
    and their weights into `weights`, the routing kernel's values, for GEMM 2 and the combine."""
    num_slots = schedule.num_slots
    num_experts, two_inter, hidden = w13_E2IH.shape
    inter = two_inter // 2
    if act_NI is None:
        act_NI = torch.empty(num_slots, inter, device=x_TH.device, dtype=x_TH.dtype)
        gate_up_N2I = torch.empty(num_slots if save_gate_up else 0, 2 * inter, device=x_TH.device, dtype=x_TH.dtype)
    else:
        gate_up_N2I = (torch.empty(num_slots, 2 * inter, device=x_TH.device, dtype=x_TH.dtype) if save_gate_up
                       else None)
    block_m, block_n, block_k, group_m, tma, cfg = split_config(config)
    tma_b = tma and _tma_ok(w13_E2IH)
    w13_desc = _descriptor(w13_E2IH.view(num_experts * two_inter, hidden), [block_n, block_k]) if tma_b else w13_E2IH
    row_programs, row_source, scan = schedule.gemm_rows(block_m)
    if route is not None:
        if not scan["SCANNED"] or schedule.ids_N.dtype != torch.int32:
            raise ValueError("launch_gemm1: routing inside GEMM 1 needs ScannedRoutes over an int32 ids buffer")
        logits_TE, weights_TK, renormalize = route
        routing = dict(ROUTE=True, RENORMALIZE=renormalize, BLOCK_E=route_blocks(num_experts, top_k)["BLOCK_E"])
    else:
        logits_TE = weights_TK = x_TH  # unread
        routing = dict(ROUTE=False, RENORMALIZE=False, BLOCK_E=1)
    grid = (row_programs * triton.cdiv(inter, block_n),)
    _gemm1_swiglu_kernel[grid](
        x_TH, w13_E2IH, w13_desc, gate_up_N2I if save_gate_up else act_NI, act_NI, logits_TE, weights_TK,
        *row_source, inter, hidden,
        x_TH.stride(0), x_TH.stride(1), w13_E2IH.stride(0), w13_E2IH.stride(1), w13_E2IH.stride(2),
        logits_TE.stride(0),
        TOP_K=top_k, SAVE_GATE_UP=save_gate_up, UPCAST=INTERPRET,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, TMA_B=tma_b, **scan, **cfg,
        **routing, **pdl_options(x_TH.device, grid[0]))
    return gate_up_N2I, act_NI


def _launch_grouped_gemm(a, b_E, b_strides, c, n_cols, k_dim, schedule: Schedule | ScannedRoutes, top_k: int,
                         config: dict, *, a_rows: tl.constexpr, c_rows: tl.constexpr, gate_up=None):
    """c[rows] = a[rows] @ B[e], B[e][k, n] at b_E + e * stride_e + k * stride_k + n * stride_n.

    a: [N, k_dim] rows addressed as a_rows says; c: [N, n_cols] (with gate_up: [N, 2 * n_cols]) rows
    addressed as c_rows says; b_E a weight tensor [E, ., .]. With gate_up ([N, 2 * n_cols], schedule
    order) given, c is d gate_up and the kernel runs the SwiGLU backward epilogue. With TMA in the
    config, B tiles come through a descriptor when B[e] is b_E[e] ([k_dim, n_cols], needs BLOCK_K |
    k_dim) or its transpose ([n_cols, k_dim]), and A tiles when a is in schedule order.
    """
    block_m, block_n, block_k, group_m, tma, cfg = split_config(config)
    prefetch_k = cfg.pop("PREFETCH_K", 0)
    lean_epilogue = cfg.pop("LEAN_EPILOGUE", 0)
    if block_n % 2:
        lean_epilogue = 0  # the SwiGLU backward's column halves need an even BLOCK_N
    if lean_epilogue == 1 and (c.stride(0) * c.shape[0] >= 2**31 or (gate_up is not None and gate_up.numel() >= 2**31)):
        lean_epilogue = 2  # int32 offsets would not reach every element of c (or of gate_up): int64 row bases
    row_programs, row_source, scan = schedule.gemm_rows(block_m)
    stride_e, stride_k, stride_n = b_strides
    grid = (row_programs * triton.cdiv(n_cols, block_n),)
    launch = pdl_options(c.device, grid[0])
    line = 128 // b_E.element_size()
    # The prefetch guesses its tile before the wait: only with PDL, only from scanned ids (valid_ids bounds any id
    # read early; a schedule's tiles may be half written by the launch just before and are not range-checked),
    # and one prefetch per line needs k contiguous.
    prefetches = prefetch_k and launch["PDL"] and scan["SCANNED"] and stride_k == 1
    prefetch_k = triton.next_power_of_2(max(prefetch_k, line)) if prefetches else 0
    # a scanned tile's rows are slots, not consecutive positions: no A descriptor
    tma_a = (tma and bool(a_rows == ROWS_POSITION) and not scan["SCANNED"] and _tma_ok(a)
             and a.shape[1] == k_dim)
    a_desc = _descriptor(a, [block_m, block_k]) if tma_a else a
    tma_b, b_desc = TMA_B_OFF, b_E
    if tma and b_E.dim() == 3 and _tma_ok(b_E):
        num_experts, rows, cols = b_E.shape
        flat = b_E.view(num_experts * rows, cols)
        if stride_k == 1 and (rows, cols) == (n_cols, k_dim):
            tma_b, b_desc = TMA_B_NK, _descriptor(flat, [block_n, block_k])
        elif stride_n == 1 and (rows, cols) == (k_dim, n_cols) and k_dim % block_k == 0:
            tma_b, b_desc = TMA_B_KN, _descriptor(flat, [block_k, block_n])
    _grouped_gemm_kernel[grid](
        a, a_desc, b_E, b_desc, c, gate_up if gate_up is not None else c,
        *row_source, n_cols, k_dim,
        a.stride(0), a.stride(1), stride_e, stride_k, stride_n, c.stride(0), c.stride(1),
        A_ROWS=a_rows, C_ROWS=c_rows, SWIGLU_BACKWARD=gate_up is not None,
        LEAN_EPILOGUE=lean_epilogue, TOP_K=top_k, UPCAST=INTERPRET,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, TMA_A=tma_a, TMA_B=tma_b, **scan, **cfg,
        PREFETCH_K=prefetch_k, LINE=line, **launch)


def launch_gemm2(act_NI: torch.Tensor, w2_EHI: torch.Tensor, y_NH: torch.Tensor,
                 schedule: Schedule | ScannedRoutes, top_k: int, config: dict) -> None:
    """GEMM 2: y[slot] = act[p] @ w2[e]^T (act in schedule order, y in slot order): B[e][k=i, n=h] = w2[e, h, i]."""
    _launch_grouped_gemm(act_NI, w2_EHI, (w2_EHI.stride(0), w2_EHI.stride(2), w2_EHI.stride(1)), y_NH,
                         w2_EHI.shape[1], w2_EHI.shape[2], schedule, top_k, config,
                         a_rows=ROWS_POSITION, c_rows=ROWS_SLOT)


def launch_bwd_act(grad_y_NH: torch.Tensor, w2_EHI: torch.Tensor, gate_up_N2I: torch.Tensor,
                   grad_gate_up_N2I: torch.Tensor, schedule: Schedule, top_k: int, config: dict, *,
                   dy_rows: tl.constexpr) -> None:
    """d gate_up[p] = swiglu'(d act[p]), d act[p] = d y[row] @ w2[e]: B[e][k=h, n=i] = w2[e, h, i].

    dy_rows: ROWS_SLOT (d y in slot order) or ROWS_POSITION (d y in schedule order, SORTED_DY)."""
    _launch_grouped_gemm(grad_y_NH, w2_EHI, (w2_EHI.stride(0), w2_EHI.stride(1), w2_EHI.stride(2)), grad_gate_up_N2I,
                         w2_EHI.shape[2], w2_EHI.shape[1], schedule, top_k, config,
                         a_rows=dy_rows, c_rows=ROWS_POSITION, gate_up=gate_up_N2I)


def launch_bwd_dx(grad_gate_up_N2I: torch.Tensor, w13_E2IH: torch.Tensor, grad_hidden_NH: torch.Tensor,
                  schedule: Schedule, top_k: int, config: dict) -> None:
    """d hidden per slot (fp32, slot order) = d gate_up[p] @ w13[e]: B[e][k=j, n=h] = w13[e, j, h]."""
    _launch_grouped_gemm(grad_gate_up_N2I, w13_E2IH, (w13_E2IH.stride(0), w13_E2IH.stride(1), w13_E2IH.stride(2)),
                         grad_hidden_NH, w13_E2IH.shape[2], w13_E2IH.shape[1], schedule, top_k, config,
                         a_rows=ROWS_POSITION, c_rows=ROWS_SLOT)


def _launch_weight_grad(a, b, out, schedule: Schedule, top_k: int, config: dict, *,
                        a_rows: tl.constexpr, b_rows: tl.constexpr) -> None:
    """out[e] = A_e^T @ B_e over expert e's rows, a: [rows, m_dim], b: [rows, n_dim], out: [E, m_dim, n_dim].

    With TMA in the config, an operand addressed by schedule position (ROWS_POSITION) loads its full
    row chunks through a descriptor (contiguous 16-bit tensors with 16-byte aligned rows only).
    """
    num_experts, m_dim, n_dim = out.shape
    block_m, block_n, block_k, _, tma, cfg = split_config(config)
    tma_a = tma and bool(a_rows == ROWS_POSITION) and _tma_ok(a) and a.shape[1] == m_dim
    tma_b = tma and bool(b_rows == ROWS_POSITION) and _tma_ok(b) and b.shape[1] == n_dim
    a_desc = _descriptor(a, [block_k, block_m]) if tma_a else a
    b_desc = _descriptor(b, [block_k, block_n]) if tma_b else b
    grid = (triton.cdiv(m_dim, block_m) * triton.cdiv(n_dim, block_n), num_experts)
    _weight_grad_kernel[grid](
        a, a_desc, b, b_desc, out, schedule.sorted_slots_N, schedule.expert_start,
        m_dim, n_dim, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        A_ROWS=a_rows, B_ROWS=b_rows, TOP_K=top_k, UPCAST=INTERPRET,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, TMA_A=tma_a, TMA_B=tma_b, **cfg)


def launch_weight_grad_w2(grad_y_NH: torch.Tensor, act_NI: torch.Tensor, grad_w2_EHI: torch.Tensor,
                          schedule: Schedule, top_k: int, config: dict, *, dy_rows: tl.constexpr) -> None:
    """d w2[e] = d y_e^T @ act_e over expert e's rows in schedule order (dy_rows: as in launch_bwd_act)."""
    _launch_weight_grad(grad_y_NH, act_NI, grad_w2_EHI, schedule, top_k, config,
                        a_rows=dy_rows, b_rows=ROWS_POSITION)


def launch_weight_grad_w13(grad_gate_up_N2I: torch.Tensor, x_TH: torch.Tensor, grad_w13_E2IH: torch.Tensor,
                           schedule: Schedule, top_k: int, config: dict,
                           x_sorted_NH: torch.Tensor | None = None) -> None:
    """d w13[e] = d gate_up_e^T @ x_e over expert e's rows in schedule order; x rows come from x_TH by
    token, or from x_sorted_NH (x gathered into schedule order, SORTED_X) when given."""
    if x_sorted_NH is not None:
        _launch_weight_grad(grad_gate_up_N2I, x_sorted_NH, grad_w13_E2IH, schedule, top_k, config,
                            a_rows=ROWS_POSITION, b_rows=ROWS_POSITION)
    else:
        _launch_weight_grad(grad_gate_up_N2I, x_TH, grad_w13_E2IH, schedule, top_k, config,
                            a_rows=ROWS_POSITION, b_rows=ROWS_TOKEN)
