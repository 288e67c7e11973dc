"""Routing kernel of the MoE layer: softmax, top-k and renormalisation per token, and its launcher.

Shapes: docs/shapes.md. The routing definition: docs/contracts.md ("Routing"); the CPU path in
mok/reference/moe.py computes the same. `route_token` is the one routing code on the GPU: the routing kernel
runs it per token, and GEMM 1 of a small decode batch runs it inside (grouped_gemm.py, ROUTE), with the same bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok.kernels.launch import cached_launch, pdl_options, wait_for_predecessor


@triton.jit
def pairwise_sum(x, BLOCK: tl.constexpr):
    """Sum of x [BLOCK] (a power of two) in a fixed tree: element i plus element i + BLOCK / 2, then the same on
    the BLOCK / 2 partial sums, and so on. Each step sums an axis of two values, one addition whatever the layout,
    so the bits do not depend on how the compiler spreads x over registers, lanes and warps (a plain tl.sum's
    tree does: a 1-warp and a 4-warp kernel sum a [128] vector in different orders)."""
    for level in tl.static_range(BLOCK.bit_length() - 1):
        x = tl.sum(tl.reshape(x, [2, BLOCK >> (level + 1)]), axis=0)
    return tl.sum(x, axis=0)


@triton.jit
def route_token(logits_ptr, ids_ptr, num_experts, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr, REPLAY: tl.constexpr):
    """One token's routing: logits_ptr its fp32 logits [num_experts]; REPLAY: its given ids at ids_ptr [TOP_K].
    -> (probs fp32 [BLOCK_E], weights fp32 [BLOCK_K], ids int32 [BLOCK_K]); entries past num_experts / TOP_K are
    padding. fp32 softmax (max, then exp, then pairwise_sum), top-k by value with ties to the lower index
    (one max over 64-bit keys per k: the probability's bits above the reversed index; probabilities are >= 0,
    so their bits order as their values), weights summed in order k = 0..K-1. Every reduction is a max or
    pairwise_sum, so the bits depend only on BLOCK_E and TOP_K, never on the warps of the calling kernel.
    Undefined routing (docs/contracts.md, "Routing": any NaN probability, that is a NaN or +Inf logit or every
    logit -Inf, which makes the sum NaN; in replay also a given id outside [0, E)): ids 0..K-1 (not in replay),
    NaN weights and NaN probs."""
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < num_experts
    logits = tl.load(logits_ptr + offs_e, mask=mask_e, other=-float("inf")).to(tl.float32)
    row_max = tl.max(logits, axis=0)
    numer = tl.where(mask_e, tl.exp(logits - row_max), 0.0)
    total_e = pairwise_sum(numer, BLOCK_E)
    probs = numer / total_e
    undefined = total_e != total_e  # a NaN numerator makes the sum NaN; finite numerators give finite probs
    probs = tl.where(undefined, float("nan"), probs)

    offs_k = tl.arange(0, BLOCK_K)
    selected = tl.zeros([BLOCK_K], dtype=tl.float32)
    selected_ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    keys = tl.where(mask_e, (probs.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BLOCK_E - 1 - offs_e), -1)
    total = tl.zeros([], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        if REPLAY:
            given = tl.load(ids_ptr + j)  # range-checked before the cast (int64 ids)
            undefined = undefined | (given < 0) | (given >= num_experts)
            idx = given.to(tl.int32)
            value = tl.max(tl.where(offs_e == idx, probs, -1.0), axis=0)
        else:
            best = tl.max(keys, axis=0)
            idx = (BLOCK_E - 1 - (best & 0xFFFFFFFF)).to(tl.int32)
            value = (best >> 32).to(tl.int32).to(tl.float32, bitcast=True)
            keys = tl.where(offs_e == idx, -1, keys)
        selected = tl.where(offs_k == j, value, selected)
        selected_ids = tl.where(offs_k == j, idx, selected_ids)
        total = total + value  # sequential, k = 0..K-1
    if RENORMALIZE:
        selected = selected / total
    selected = tl.where(undefined, float("nan"), selected)
    selected_ids = tl.where(undefined, offs_k, selected_ids)
    return probs, selected, selected_ids


@cached_launch
@triton.jit
def _route_kernel(logits_ptr, ids_ptr, weights_ptr, probs_ptr, num_experts, stride_logits,
                  TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                  RENORMALIZE: tl.constexpr, REPLAY: tl.constexpr, PDL: tl.constexpr):
    """One program per token: route_token, stored. REPLAY: ids are given (read from ids_ptr) and only their
    weights are computed. Other tokens are untouched by a token's undefined routing; nothing is read out of
    bounds. PDL: launched with programmatic dependent launch (mok/kernels/launch.py).
    """
    wait_for_predecessor(PDL)
    token = tl.program_id(0).to(tl.int64)
    probs, selected, selected_ids = route_token(logits_ptr + token * stride_logits, ids_ptr + token * TOP_K,
                                                num_experts, TOP_K, BLOCK_E, BLOCK_K, RENORMALIZE, REPLAY)
    offs_e = tl.arange(0, BLOCK_E)
    tl.store(probs_ptr + token * num_experts + offs_e, probs, mask=offs_e < num_experts)
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < TOP_K
    tl.store(weights_ptr + token * TOP_K + offs_k, selected, mask=mask_k)
    if not REPLAY:
        tl.store(ids_ptr + token * TOP_K + offs_k, selected_ids, mask=mask_k)


def route_blocks(num_experts: int, top_k: int) -> dict:
    """The constexprs route_token takes from the layer's sizes: BLOCK_E and BLOCK_K."""
    return dict(BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_K=triton.next_power_of_2(top_k))


def launch_route(logits_TE: torch.Tensor, top_k: int, renormalize: bool, ids_TK: torch.Tensor | None = None,
                 out: tuple | None = None):
    """-> (ids int32 [T, K], weights fp32 [T, K], probs fp32 [T, E]); with ids_TK given (replay), those
    ids come back and only their weights are computed. logits_TE must be contiguous. `out`: contiguous
    buffers (ids or None in replay, weights, probs) to write instead of fresh tensors (same launch)."""
    num_tokens, num_experts = logits_TE.shape
    device = logits_TE.device
    replay = ids_TK is not None
    if out is not None:
        out_ids_TK, weights_TK, probs_TE = out
        if not replay:
            ids_TK = out_ids_TK
    else:
        if not replay:
            ids_TK = torch.empty(num_tokens, top_k, device=device, dtype=torch.int32)
        weights_TK = torch.empty(num_tokens, top_k, device=device, dtype=torch.float32)
        probs_TE = torch.empty(num_tokens, num_experts, device=device, dtype=torch.float32)
    if num_tokens:
        blocks = route_blocks(num_experts, top_k)
        _route_kernel[(num_tokens,)](
            logits_TE, ids_TK, weights_TK, probs_TE, num_experts, logits_TE.stride(0),
            TOP_K=top_k, RENORMALIZE=renormalize, REPLAY=replay, **blocks,
            num_warps=1, **pdl_options(device))
    return ids_TK, weights_TK, probs_TE
