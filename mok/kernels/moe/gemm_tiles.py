"""What every grouped GEMM of the MoE layer shares (kernels: gemm1.py, gemm2.py, weight_grad.py; launchers:
grouped_gemm.py): how a schedule position addresses an operand's rows, the fp32 dot, the row tile of a program
(from the schedule's tiles or, for small batches, from the ids themselves) and the program swizzle.

Shapes: docs/shapes.md. Kernel rules: grouped_gemm.py's docstring and docs/kernels.md.
"""
from __future__ import annotations

import triton
import triton.language as tl

from mok.kernels.moe.schedule import valid_ids

# How a schedule position p addresses an operand's rows (the A_ROWS / B_ROWS / C_ROWS constexprs).
ROWS_POSITION = tl.constexpr(0)  # row p: the operand is in schedule order
ROWS_SLOT = tl.constexpr(1)  # row sorted_slots_N[p]: the operand is in slot order
ROWS_TOKEN = tl.constexpr(2)  # row sorted_slots_N[p] // K: one row per token (x_TH)


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
def _swizzle(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Group GROUP_M row tiles per column sweep (L2 reuse of the weight tiles)."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n
