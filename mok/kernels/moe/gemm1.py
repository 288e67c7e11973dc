"""GEMM 1 + SwiGLU of the MoE layer: gate_up = x[token] @ w13[e]^T per schedule row, act = silu(gate) * up,
optionally routing a small decode batch itself first (ROUTE). Launcher: grouped_gemm.launch_gemm1.

Shapes: docs/shapes.md. Kernel rules: grouped_gemm.py's docstring and docs/kernels.md.
"""
from __future__ import annotations

import triton
import triton.language as tl

from mok.kernels.launch import cached_launch, wait_for_predecessor
from mok.kernels.moe.gemm_tiles import _dot, _gemm_rows, _swizzle, _tile_of_slot
from mok.kernels.moe.routing import route_token


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
