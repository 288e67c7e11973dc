"""The routing kernel before the nineteenth session (commit f4b20d4, mok/kernels/moe/routing.py), kept for the
A/B of route_in_gemm1_ab.py: tl.sum over [BLOCK_E] (the tree follows the compiled layout) and two reductions per k."""
import triton
import triton.language as tl

from mok.kernels.launch import wait_for_predecessor


@triton.jit
def route_kernel_before(logits_ptr, ids_ptr, weights_ptr, probs_ptr, num_experts, stride_logits,
                  TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                  RENORMALIZE: tl.constexpr, REPLAY: tl.constexpr, PDL: tl.constexpr):
    """One program per token: fp32 softmax over E, top-k by value (ties -> lower index), renormalize.

    The reduction trees of max/sum depend only on BLOCK_E (chosen from E), never on T.
    REPLAY: ids are given (read from ids_ptr) and only their weights are computed.
    Undefined routing (docs/contracts.md, "Routing": any NaN among the probabilities, that is a NaN or
    +Inf logit or every logit -Inf; in replay also a given id outside [0, E)): ids 0..K-1 (not in
    replay), NaN weights and a NaN probs row. Other tokens are untouched; nothing is read out of bounds.
    PDL: launched with programmatic dependent launch (mok/kernels/launch.py).
    """
    wait_for_predecessor(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < num_experts
    logits = tl.load(logits_ptr + token * stride_logits + offs_e, mask=mask_e, other=-float("inf")).to(tl.float32)
    row_max = tl.max(logits, axis=0)
    numer = tl.where(mask_e, tl.exp(logits - row_max), 0.0)
    probs = numer / tl.sum(numer, axis=0)
    undefined = tl.max((mask_e & (probs != probs)).to(tl.int32), axis=0) > 0
    probs = tl.where(undefined, float("nan"), probs)
    tl.store(probs_ptr + token * num_experts + offs_e, probs, mask=mask_e)

    offs_k = tl.arange(0, BLOCK_K)
    selected = tl.zeros([BLOCK_K], dtype=tl.float32)
    selected_ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    remaining = tl.where(mask_e, probs, -1.0)  # probabilities are >= 0: -1 marks "not eligible"
    total = tl.zeros([], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        if REPLAY:
            given = tl.load(ids_ptr + token * TOP_K + j)  # range-checked before the cast (int64 ids)
            undefined = undefined | (given < 0) | (given >= num_experts)
            idx = given.to(tl.int32)
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
    selected = tl.where(undefined, float("nan"), selected)
    selected_ids = tl.where(undefined, offs_k, selected_ids)
    mask_k = offs_k < TOP_K
    tl.store(weights_ptr + token * TOP_K + offs_k, selected, mask=mask_k)
    if not REPLAY:
        tl.store(ids_ptr + token * TOP_K + offs_k, selected_ids, mask=mask_k)


