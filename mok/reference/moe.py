"""CPU reference path of the MoE layer: routing, forward and backward, batch-invariant by construction.

Shapes: docs/shapes.md (N = T * K routed slots, slot n = t * K + k; "schedule order" lists the N
slots grouped by expert, stable).

Semantics (shared with the Triton path in mok/kernels/moe/; the rounding points are the same; routing:
docs/contracts.md, "Routing"):
  routing   p = softmax(fp32 logits); top-k by value, ties to the lower expert index;
            weights = p[top-k] / sum_k p[top-k] (sum in order k = 0..K-1) if renormalize; fp32.
            Undefined routing (a NaN among p): experts 0..K-1, NaN weights (docs/contracts.md, "Routing").
  schedule  slots sorted by expert, stable: inside an expert by token index, then k.
  GEMM 1    gate_up = round(x[token] @ w13[e]^T)                  fp32 accumulate, rounded to x.dtype
  SwiGLU    act     = round(silu(gate) * up)                      fp32 math, rounded to x.dtype
  GEMM 2    y[slot] = round(act @ w2[e]^T)                        fp32 accumulate, rounded to x.dtype
  combine   out[t]  = round(sum_{k=0..K-1} weight[t, k] * y[t, k])  fp32, in k order, rounded once

Why no reduction here can depend on the batch: every matmul is `matmul_nt` (a sequential loop over
the reduction index of element-wise multiplies and adds, mok/reference/reduce.py), every other sum
is `sum_last` or an explicit loop over k, the softmax max is exact, and transcendental functions come
from mok/reference/elementwise.py (position-independent). Each element-wise op is exactly rounded
per element whatever the tensor's size, so a token's row depends only on its own inputs, never on
which other tokens share its expert. BLAS is never called. The backward (deterministic, not
batch-invariant by contract) reuses the same sequential primitives.
"""
from __future__ import annotations

import torch

from mok.reference import elementwise
from mok.reference.reduce import matmul_nt, sum_last

# ----------------------------------------------------------------------------------------------
# routing


def softmax_fp32(logits_TE: torch.Tensor) -> torch.Tensor:
    """Row softmax in fp32 [T, E] -> fp32 [T, E]: exact max, position-independent exp, sequential sum."""
    logits_TE = logits_TE.float()
    max_T1 = torch.amax(logits_TE, dim=-1, keepdim=True)
    num_TE = elementwise.exp(logits_TE - max_T1)
    return num_TE / sum_last(num_TE)[:, None]


def topk_lowest_index(probs_TE: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of each row by value, ties to the lower index: K steps of an exact argmax.

    probs_TE: fp32 [T, E] with values >= 0. Returns (ids int32 [T, K], values fp32 [T, K]) in
    selection order (descending value, ascending index among equal values).
    """
    num_tokens, num_experts = probs_TE.shape
    expert_E = torch.arange(num_experts, dtype=torch.int64)
    remaining_TE = probs_TE.clone()
    ids, values = [], []
    for _ in range(top_k):
        best_T = torch.amax(remaining_TE, dim=-1)
        is_best_TE = remaining_TE == best_T[:, None]
        idx_T = torch.where(is_best_TE, expert_E[None, :], num_experts).amin(dim=-1)
        ids.append(idx_T)
        values.append(best_T)
        # Probabilities are >= 0, so -1 takes a chosen expert out of the later steps.
        remaining_TE = remaining_TE.scatter(1, idx_T[:, None], -1.0)
    return torch.stack(ids, dim=1).to(torch.int32), torch.stack(values, dim=1)


def renormalize_fp32(selected_TK: torch.Tensor) -> torch.Tensor:
    """weights / sum of the row's weights, the sum taken in order k = 0..K-1. fp32 [T, K]."""
    return selected_TK / sum_last(selected_TK)[:, None]


def undefined_rows(probs_TE: torch.Tensor) -> torch.Tensor:
    """bool [T, 1]: rows whose routing is undefined (docs/contracts.md, "Routing"): any NaN among the
    softmax probabilities (a NaN or +Inf logit, or every logit -Inf)."""
    return torch.isnan(probs_TE).any(dim=-1, keepdim=True)


def route(logits_TE: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Routing from logits [T, E] (any float dtype).

    Returns (topk_ids int32 [T, K], topk_weights fp32 [T, K], probs fp32 [T, E]). A row of undefined
    routing (undefined_rows) gets ids 0..K-1, NaN weights and a NaN probs row; other rows are untouched.
    """
    probs_TE = softmax_fp32(logits_TE)
    bad_T1 = undefined_rows(probs_TE)
    # NaN never equals the row max: take the top-k of zeros for those rows (ids 0..K-1), then mark them.
    ids_TK, selected_TK = topk_lowest_index(probs_TE.masked_fill(bad_T1, 0.0), top_k)
    weights_TK = renormalize_fp32(selected_TK) if renormalize else selected_TK
    nan = float("nan")
    return ids_TK, weights_TK.masked_fill(bad_T1, nan), probs_TE.masked_fill(bad_T1, nan)


def replay_weights(logits_TE: torch.Tensor, ids_TK: torch.Tensor,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights of given experts from logits: (weights fp32 [T, K], probs fp32 [T, E]).
    A row of undefined routing gets NaN weights and a NaN probs row (as in route)."""
    probs_TE = softmax_fp32(logits_TE)
    bad_T1 = undefined_rows(probs_TE)
    selected_TK = probs_TE.gather(1, ids_TK.long())
    weights_TK = renormalize_fp32(selected_TK) if renormalize else selected_TK
    nan = float("nan")
    return weights_TK.masked_fill(bad_T1, nan), probs_TE.masked_fill(bad_T1, nan)


def route_backward(grad_weights_TK: torch.Tensor, probs_TE: torch.Tensor, ids_TK: torch.Tensor,
                   weights_TK: torch.Tensor, renormalize: bool) -> torch.Tensor:
    """d loss / d logits [T, E] fp32 from d loss / d topk_weights [T, K] (both paths; deterministic).

    With renormalize, w_k = p_k / S and S = sum_j p_j, so dp_k = (dw_k - sum_j dw_j w_j) / S.
    Softmax: dlogit_e = p_e * (dp_e - sum_f p_f dp_f). Only scatter (no add) and fixed-shape sums.
    """
    grad_weights_TK = grad_weights_TK.float()
    num_experts, top_k = probs_TE.shape[1], ids_TK.shape[1]
    # Replayed ids outside [0, E) (CUDA does not check them on the host) index experts 0..K-1 instead,
    # as in the forward (their weights are NaN there): no out-of-bounds gather or scatter.
    out_of_range_T1 = ((ids_TK < 0) | (ids_TK >= num_experts)).any(dim=-1, keepdim=True)
    ids_TK = torch.where(out_of_range_T1, torch.arange(top_k, device=ids_TK.device), ids_TK.long())
    if renormalize:
        total_T1 = probs_TE.gather(1, ids_TK).sum(dim=-1, keepdim=True)
        grad_selected_TK = (grad_weights_TK - (grad_weights_TK * weights_TK).sum(dim=-1, keepdim=True)) / total_T1
    else:
        grad_selected_TK = grad_weights_TK
    grad_probs_TE = torch.zeros_like(probs_TE).scatter(1, ids_TK, grad_selected_TK)
    return probs_TE * (grad_probs_TE - (probs_TE * grad_probs_TE).sum(dim=-1, keepdim=True))


# ----------------------------------------------------------------------------------------------
# expert schedule, forward, backward


def schedule(ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots grouped by expert, stable: (sorted_slots_N int64 [N], expert_start int64 [E + 1]).

    Expert e's slots are sorted_slots_N[expert_start[e]:expert_start[e + 1]], in slot order (token, k).
    """
    sorted_ids_N, sorted_slots_N = torch.sort(ids_TK.reshape(-1).long(), stable=True)
    expert_start = torch.searchsorted(sorted_ids_N, torch.arange(num_experts + 1, device=ids_TK.device))
    return sorted_slots_N, expert_start


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32 (inputs in the activation dtype); the caller rounds."""
    return elementwise.silu(gate) * up.float()


def moe_forward(hidden_TH: torch.Tensor, w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor, ids_TK: torch.Tensor,
                weights_TK: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Expert computation for given routes (CPU).

    hidden_TH [T, H], w13_E2IH [E, 2I, H], w2_EHI [E, H, I] (one float dtype), ids_TK int [T, K],
    weights_TK fp32 [T, K]. Returns (out [T, H], gate_up [N, 2I], act [N, I] (both in schedule order),
    y [N, H] (slot order), sorted_slots int64 [N], expert_start int64 [E + 1]); everything but out is kept
    for the backward. = experts_forward, then combine (the expert-parallel path runs the same two pieces on
    different ranks: mok/distributed.py).
    """
    gate_up_N2I, act_NI, y_NH, sorted_slots_N, expert_start = experts_forward(hidden_TH, w13_E2IH, w2_EHI, ids_TK)
    out_TH = combine(y_NH, weights_TK, ids_TK.shape[1])
    return out_TH, gate_up_N2I, act_NI, y_NH, sorted_slots_N, expert_start


def experts_forward(hidden_TH: torch.Tensor, w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor, ids_TK: torch.Tensor
                    ) -> tuple[torch.Tensor, ...]:
    """The experts of every slot, before the combine: (gate_up [N, 2I], act [N, I] (both in schedule
    order), y [N, H] (slot order), sorted_slots int64 [N], expert_start int64 [E + 1]).

    Slot n = t * K + k reads hidden row t. Each row's bits depend only on that row and its expert.
    """
    dtype = hidden_TH.dtype
    num_tokens, hidden = hidden_TH.shape
    num_experts, two_inter, _ = w13_E2IH.shape
    inter = two_inter // 2
    top_k = ids_TK.shape[1]
    sorted_slots_N, expert_start = schedule(ids_TK, num_experts)
    num_slots = num_tokens * top_k
    gate_up_N2I = torch.zeros(num_slots, two_inter, dtype=dtype)
    act_NI = torch.zeros(num_slots, inter, dtype=dtype)
    y_NH = torch.zeros(num_slots, hidden, dtype=dtype)
    bounds = expert_start.tolist()
    for e in range(num_experts):
        lo, hi = bounds[e], bounds[e + 1]
        if lo == hi:
            continue
        slots = sorted_slots_N[lo:hi]
        gate_up = matmul_nt(hidden_TH[slots // top_k], w13_E2IH[e]).to(dtype)
        act = silu_mul(gate_up[:, :inter], gate_up[:, inter:]).to(dtype)
        gate_up_N2I[lo:hi] = gate_up
        act_NI[lo:hi] = act
        y_NH[slots] = matmul_nt(act, w2_EHI[e]).to(dtype)
    return gate_up_N2I, act_NI, y_NH, sorted_slots_N, expert_start


def combine(y_NH: torch.Tensor, weights_TK: torch.Tensor, top_k: int) -> torch.Tensor:
    """out[t] = round(sum_{k=0..K-1} weight[t, k] * y[t * K + k]): fp32, k in order, rounded once to y's dtype.

    y_NH [N, H] in slot order, weights_TK fp32 [T, K] -> [T, H]."""
    num_tokens = weights_TK.shape[0]
    y_TKH = y_NH.view(num_tokens, top_k, y_NH.shape[1])
    acc_TH = torch.zeros(num_tokens, y_NH.shape[1], dtype=torch.float32)
    for k in range(top_k):
        # Multiply, then add: two roundings, the same for every row.
        acc_TH = acc_TH + weights_TK[:, k:k + 1].float() * y_TKH[:, k].float()
    return acc_TH.to(y_NH.dtype)


def swiglu_backward(grad_act: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) in fp32 of act = silu(gate) * up, given d act (fp32)."""
    gate = gate.float()
    up = up.float()
    sig = elementwise.sigmoid(gate)
    grad_gate = grad_act * up * sig * (1.0 + gate * (1.0 - sig))
    grad_up = grad_act * (gate * sig)
    return grad_gate, grad_up


def moe_backward(grad_out_TH: torch.Tensor, hidden_TH: torch.Tensor, w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor,
                 ids_TK: torch.Tensor, weights_TK: torch.Tensor, gate_up_N2I: torch.Tensor, act_NI: torch.Tensor,
                 y_NH: torch.Tensor, sorted_slots_N: torch.Tensor, expert_start: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (d hidden [T, H], d w13 [E, 2I, H], d w2 [E, H, I] in their dtypes, d weights fp32 [T, K]).

    Rounding points mirror the Triton backward: d y = round(weight * d out) and d gate_up are rounded
    to the activation dtype before the matmuls (fp32 accumulate); per-slot d hidden stays fp32 and
    is summed over k in order, then rounded once; weight gradients accumulate in fp32.
    = combine_backward, experts_backward, sum_slots (the pieces the expert-parallel path shares).
    """
    top_k = ids_TK.shape[1]
    grad_y_NH, grad_weights_TK = combine_backward(grad_out_TH, y_NH, weights_TK)
    grad_hidden_NH, grad_w13_E2IH, grad_w2_EHI = experts_backward(
        grad_y_NH, hidden_TH, w13_E2IH, w2_EHI, top_k, gate_up_N2I, act_NI, sorted_slots_N, expert_start)
    return sum_slots(grad_hidden_NH, top_k, hidden_TH.dtype), grad_w13_E2IH, grad_w2_EHI, grad_weights_TK


def combine_backward(grad_out_TH: torch.Tensor, y_NH: torch.Tensor, weights_TK: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(d y [N, H] = round(weight * d out) in y's dtype, slot order; d weights fp32 [T, K] = <d out, y>).

    d out is rounded to y's dtype first (as the Triton backward does)."""
    dtype = y_NH.dtype
    num_tokens, top_k = weights_TK.shape
    hidden = y_NH.shape[1]
    grad_out_TH = grad_out_TH.to(dtype)
    y_TKH = y_NH.view(num_tokens, top_k, hidden)
    grad_weights_TK = torch.stack([sum_last(grad_out_TH.float() * y_TKH[:, k].float()) for k in range(top_k)], dim=1)
    grad_y_NH = (weights_TK.float()[:, :, None] * grad_out_TH.float()[:, None, :]).to(dtype)
    return grad_y_NH.reshape(num_tokens * top_k, hidden), grad_weights_TK.reshape(num_tokens, top_k)


def experts_backward(grad_y_NH: torch.Tensor, hidden_TH: torch.Tensor, w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor,
                     top_k: int, gate_up_N2I: torch.Tensor, act_NI: torch.Tensor, sorted_slots_N: torch.Tensor,
                     expert_start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d hidden per slot fp32 [N, H] (slot order, not yet summed over k), d w13 [E, 2I, H], d w2 [E, H, I]).

    grad_y_NH: [N, H] in the activation dtype, slot order. Expert e's weight gradients reduce over its
    rows in schedule order (slot order inside the expert) in fp32, rounded once to the weights' dtype.
    """
    dtype = hidden_TH.dtype
    hidden = hidden_TH.shape[1]
    num_experts, two_inter, _ = w13_E2IH.shape
    inter = two_inter // 2
    grad_hidden_NH = torch.zeros(grad_y_NH.shape[0], hidden, dtype=torch.float32)
    grad_w13_E2IH = torch.zeros(w13_E2IH.shape, dtype=torch.float32)
    grad_w2_EHI = torch.zeros(w2_EHI.shape, dtype=torch.float32)
    bounds = expert_start.tolist()
    for e in range(num_experts):
        lo, hi = bounds[e], bounds[e + 1]
        if lo == hi:
            continue
        slots = sorted_slots_N[lo:hi]
        grad_y = grad_y_NH[slots]
        grad_act = matmul_nt(grad_y, w2_EHI[e].t())
        grad_w2_EHI[e] = matmul_nt(grad_y.t(), act_NI[lo:hi].t())
        gate_up = gate_up_N2I[lo:hi]
        grad_gate, grad_up = swiglu_backward(grad_act, gate_up[:, :inter], gate_up[:, inter:])
        grad_gate_up = torch.cat([grad_gate, grad_up], dim=1).to(dtype)
        grad_hidden_NH[slots] = matmul_nt(grad_gate_up, w13_E2IH[e].t())
        grad_w13_E2IH[e] = matmul_nt(grad_gate_up.t(), hidden_TH[slots // top_k].t())
    return grad_hidden_NH, grad_w13_E2IH.to(w13_E2IH.dtype), grad_w2_EHI.to(w2_EHI.dtype)


def sum_slots(grad_hidden_NH: torch.Tensor, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """sum over k = 0..K-1 in order of the fp32 per-slot rows [N, H] -> [T, H], rounded once to dtype."""
    num_tokens = grad_hidden_NH.shape[0] // top_k
    grad_hidden_TKH = grad_hidden_NH.view(num_tokens, top_k, grad_hidden_NH.shape[1])
    acc_TH = torch.zeros(num_tokens, grad_hidden_NH.shape[1], dtype=torch.float32)
    for k in range(top_k):
        acc_TH = acc_TH + grad_hidden_TKH[:, k]
    return acc_TH.to(dtype)
