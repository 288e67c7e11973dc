"""Triton kernels of mok.route_grouped (the DeepSeek-V3 / GLM-4.5 routing), forward, replay and backward.

Shapes: docs/shapes.md. The definition: docs/contracts.md ("Grouped routing"); the CPU reference
mok/reference/grouped_routing.py computes the same with the same rounding points. One program per token over its
whole row, the experts laid out as a [groups, experts per group] tile. Every selection is a max over unique 64-bit
keys (a value's order-preserving bits above the reversed index, so ties go to the lower index), exact whatever the
warps; the only float sums run over k = 0..K-1 in a scalar loop. No pairwise_sum is needed: no sum runs over a
vector. The sigmoid is fp64 math rounded once to fp32, as on the CPU. Launched without FMA contraction, and the fp32
divisions are `tl.div_rn` (Triton's `/` is an approximate division on CUDA), so that each step is the reference's
IEEE operation (only the fp64 exp differs: libdevice's against the reference's).
Literals in the kernels: 1e-20, transformers' addend to the sum of the weights (fp32); `lowest` = -(2**63), a key
below every real key (padding, experts out of the race); 0x7FFFFFFF - index, a key's low 32 bits (lower index wins).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok.kernels.launch import cached_launch, pdl_options, wait_for_predecessor

# Literals, not module constexprs: the interpreter evaluates `constexpr - tensor` to a constexpr and fails.


@triton.jit
def _order_bits(x):
    """int64 whose signed order is fp32 x's order (negatives' magnitude bits flipped), shifted into the high half."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) << 32


@triton.jit
def _key_value(key):
    """The fp32 value whose _order_bits are key's high half."""
    bits = (key >> 32).to(tl.int32)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.float32, bitcast=True)


@triton.jit
def _sigmoid(logits):
    """fp32 sigmoid of fp32 logits: fp64 math, one rounding (mok/reference/elementwise.py's sigmoid)."""
    return (1.0 / (1.0 + tl.exp(-logits.to(tl.float64)))).to(tl.float32)


@triton.jit
def _max2d(x):
    return tl.max(tl.max(x, axis=1), axis=0)


@triton.jit
def grouped_route_token(logits_ptr, bias_ptr, ids_ptr, num_experts, n_group, group_size, scaling,
                        TOP_K: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
                        BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr,
                        RENORMALIZE: tl.constexpr, REPLAY: tl.constexpr):
    """One token: logits_ptr its logits [num_experts]; REPLAY: its given ids at ids_ptr [TOP_K].
    -> (weights fp32 [BLOCK_K], ids int32 [BLOCK_K]); entries past TOP_K are padding. GROUPED: topk_group < n_group
    (otherwise every expert is kept and no group score is computed). Undefined routing (a NaN choice score, a NaN
    group score, in replay a given id outside [0, E)): ids 0..K-1 (not in replay) and NaN weights."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_s = tl.arange(0, BLOCK_S)
    expert = offs_g[:, None] * group_size + offs_s[None, :]
    valid = (offs_g < n_group)[:, None] & (offs_s < group_size)[None, :]
    scores = _sigmoid(tl.load(logits_ptr + expert, mask=valid, other=0.0).to(tl.float32))
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + expert, mask=valid, other=0.0)
    undefined = _max2d(tl.where(valid & (choice != choice), 1, 0)) > 0
    lowest = -9223372036854775808
    keys = tl.where(valid, _order_bits(choice) | (0x7FFFFFFF - expert).to(tl.int64), lowest)
    if GROUPED:
        first = tl.max(keys, axis=1)  # keys are unique: the second largest is the largest of the others
        second = tl.max(tl.where(keys == first[:, None], lowest, keys), axis=1)
        group = _key_value(first) + _key_value(second)
        real_group = offs_g < n_group
        undefined = undefined | (tl.max(tl.where(real_group & (group != group), 1, 0), axis=0) > 0)
        group_keys = tl.where(real_group, _order_bits(group) | (0x7FFFFFFF - offs_g).to(tl.int64), lowest)
        kept = offs_g < 0
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(group_keys, axis=0)
            kept = kept | (group_keys == best)
            group_keys = tl.where(group_keys == best, lowest, group_keys)
        keys = tl.where(kept[:, None], keys, lowest)

    offs_k = tl.arange(0, BLOCK_K)
    selected = tl.zeros([BLOCK_K], dtype=tl.float32)
    selected_ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    total = tl.zeros([], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        if REPLAY:
            given = tl.load(ids_ptr + j)  # range-checked before the cast (int64 ids)
            undefined = undefined | (given < 0) | (given >= num_experts)
            idx = given.to(tl.int32)
        else:
            best = _max2d(keys)
            idx = (0x7FFFFFFF - (best & 0xFFFFFFFF)).to(tl.int32)
            keys = tl.where(expert == idx, lowest, keys)
        value = _max2d(tl.where(valid & (expert == idx), scores, -1.0))
        selected = tl.where(offs_k == j, value, selected)
        selected_ids = tl.where(offs_k == j, idx, selected_ids)
        total = total + value  # sequential, k = 0..K-1
    if RENORMALIZE:
        selected = tl.div_rn(selected, total + 1e-20)
    selected = selected * scaling
    selected = tl.where(undefined, float("nan"), selected)
    selected_ids = tl.where(undefined, offs_k, selected_ids)
    return selected, selected_ids


@cached_launch
@triton.jit
def _grouped_route_kernel(logits_ptr, bias_ptr, ids_ptr, weights_ptr, num_experts, n_group, group_size, scaling,
                          stride_logits, TOP_K: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                          BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                          GROUPED: tl.constexpr, RENORMALIZE: tl.constexpr, REPLAY: tl.constexpr, PDL: tl.constexpr):
    """One program per token: grouped_route_token, stored (REPLAY: only the weights of the ids read from ids_ptr)."""
    wait_for_predecessor(PDL)
    token = tl.program_id(0).to(tl.int64)
    selected, selected_ids = grouped_route_token(
        logits_ptr + token * stride_logits, bias_ptr, ids_ptr + token * TOP_K, num_experts, n_group, group_size,
        scaling, TOP_K, TOPK_GROUP, BLOCK_G, BLOCK_S, BLOCK_K, HAS_BIAS, GROUPED, RENORMALIZE, REPLAY)
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < TOP_K
    tl.store(weights_ptr + token * TOP_K + offs_k, selected, mask=mask_k)
    if not REPLAY:
        tl.store(ids_ptr + token * TOP_K + offs_k, selected_ids, mask=mask_k)


@cached_launch
@triton.jit
def _grouped_route_backward_kernel(grad_ptr, logits_ptr, ids_ptr, weights_ptr, out_ptr, num_experts, scaling,
                                   stride_grad, stride_logits, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                                   BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr, PDL: tl.constexpr):
    """One program per token: d logits fp32 [E] of mok/reference/grouped_routing.py's route_grouped_backward, the
    same operations in the same order (sums over k = 0..K-1 in a scalar loop; a given id adds to its expert in k
    order). A row whose weights hold a NaN (undefined routing) gets a NaN row; ids outside [0, E) act as 0..K-1."""
    wait_for_predecessor(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < num_experts
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < TOP_K
    scores = _sigmoid(tl.load(logits_ptr + token * stride_logits + offs_e, mask=mask_e, other=0.0).to(tl.float32))
    weights = tl.load(weights_ptr + token * TOP_K + offs_k, mask=mask_k, other=0.0)
    undefined = tl.max(tl.where(weights != weights, 1, 0), axis=0) > 0
    given = tl.load(ids_ptr + token * TOP_K + offs_k, mask=mask_k, other=0)
    out_of_range = tl.max(tl.where(mask_k & ((given < 0) | (given >= num_experts)), 1, 0), axis=0) > 0
    grad_row_ptr = grad_ptr + token * stride_grad
    total = tl.zeros([], dtype=tl.float32)
    dot = tl.zeros([], dtype=tl.float32)
    if RENORMALIZE:
        for j in tl.static_range(TOP_K):
            idx = tl.where(out_of_range, j, tl.load(ids_ptr + token * TOP_K + j).to(tl.int32))
            total = total + tl.max(tl.where(offs_e == idx, scores, -1.0), axis=0)
        total = total + 1e-20
        for j in tl.static_range(TOP_K):
            idx = tl.where(out_of_range, j, tl.load(ids_ptr + token * TOP_K + j).to(tl.int32))
            share = tl.div_rn(tl.max(tl.where(offs_e == idx, scores, -1.0), axis=0), total)
            dot = dot + (tl.load(grad_row_ptr + j).to(tl.float32) * scaling) * share
    grad_scores = tl.zeros([BLOCK_E], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        idx = tl.where(out_of_range, j, tl.load(ids_ptr + token * TOP_K + j).to(tl.int32))
        grad_j = tl.load(grad_row_ptr + j).to(tl.float32) * scaling
        if RENORMALIZE:
            grad_j = tl.div_rn(grad_j - dot, total)
        grad_scores = tl.where(offs_e == idx, grad_scores + grad_j, grad_scores)
    grad_logits = grad_scores * (scores * (1.0 - scores))
    grad_logits = tl.where(undefined, float("nan"), grad_logits)
    tl.store(out_ptr + token * num_experts + offs_e, grad_logits, mask=mask_e)


def route_grouped_blocks(num_experts: int, n_group: int, top_k: int) -> dict:
    """The tile constexprs: BLOCK_G groups by BLOCK_S experts per group, BLOCK_K."""
    return dict(BLOCK_G=triton.next_power_of_2(n_group), BLOCK_S=triton.next_power_of_2(num_experts // n_group),
                BLOCK_K=triton.next_power_of_2(top_k))


def launch_route_grouped(logits_TE: torch.Tensor, bias_E: torch.Tensor | None, top_k: int, n_group: int,
                         topk_group: int, renormalize: bool, scaling: float,
                         ids_TK: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (ids int32 [T, K], weights fp32 [T, K]); with ids_TK given (replay) those ids come back and only their
    weights are computed. logits_TE contiguous rows; bias_E fp32 contiguous or None (arguments checked by the op)."""
    num_tokens, num_experts = logits_TE.shape
    device = logits_TE.device
    replay = ids_TK is not None
    if not replay:
        ids_TK = torch.empty(num_tokens, top_k, device=device, dtype=torch.int32)
    weights_TK = torch.empty(num_tokens, top_k, device=device, dtype=torch.float32)
    if num_tokens:
        _grouped_route_kernel[(num_tokens,)](
            logits_TE, logits_TE if bias_E is None else bias_E, ids_TK, weights_TK, num_experts, n_group,
            num_experts // n_group, scaling, logits_TE.stride(0), TOP_K=top_k, TOPK_GROUP=topk_group,
            HAS_BIAS=bias_E is not None, GROUPED=topk_group < n_group, RENORMALIZE=renormalize, REPLAY=replay,
            **route_grouped_blocks(num_experts, n_group, top_k), num_warps=1, enable_fp_fusion=False,
            **pdl_options(device))
    return ids_TK, weights_TK


def launch_route_grouped_backward(grad_weights_TK: torch.Tensor, logits_TE: torch.Tensor, ids_TK: torch.Tensor,
                                  weights_TK: torch.Tensor, renormalize: bool, scaling: float) -> torch.Tensor:
    """d logits fp32 [T, E] from d weights [T, K]; every tensor with contiguous rows."""
    num_tokens, num_experts = logits_TE.shape
    top_k = ids_TK.shape[1]
    grad_logits_TE = torch.empty(num_tokens, num_experts, device=logits_TE.device, dtype=torch.float32)
    if num_tokens:
        _grouped_route_backward_kernel[(num_tokens,)](
            grad_weights_TK, logits_TE, ids_TK, weights_TK, grad_logits_TE, num_experts, scaling,
            grad_weights_TK.stride(0), logits_TE.stride(0), TOP_K=top_k, BLOCK_E=triton.next_power_of_2(num_experts),
            BLOCK_K=triton.next_power_of_2(top_k), RENORMALIZE=renormalize, num_warps=1, enable_fp_fusion=False,
            **pdl_options(logits_TE.device))
    return grad_logits_TE
