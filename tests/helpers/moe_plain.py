"""Plain-torch MoE references shared by the MoE tests (no tests here; autograd-differentiable, not batch-invariant).

Shapes: docs/shapes.md.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def plain_route(logits_TE: torch.Tensor, top_k: int, renormalize: bool = True):
    """softmax (fp32) -> top-k (stable: ties to the lower index) -> renormalize. Differentiable weights."""
    probs_TE = torch.softmax(logits_TE.float(), dim=-1)
    ids_TK = torch.sort(-probs_TE.detach(), dim=-1, stable=True).indices[:, :top_k]
    weights_TK = probs_TE.gather(1, ids_TK)
    if renormalize:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    return ids_TK, weights_TK


def plain_routes(logits_TE, top_k, renormalize, topk_ids=None, topk_weights=None):
    """(ids, weights) as mok.moe resolves them: routed from the logits, replayed ids with weights
    recomputed from the logits, or both replayed as given."""
    if topk_ids is None:
        return plain_route(logits_TE, top_k, renormalize)
    if topk_weights is None:
        probs_TE = torch.softmax(logits_TE.float(), dim=-1)
        topk_weights = probs_TE.gather(1, topk_ids.long())
        if renormalize:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_ids, topk_weights


def plain_moe(hidden_TH, logits_TE, w13_E2IH, w2_EHI, top_k, renormalize=True, topk_ids=None, topk_weights=None,
              rounded=True):
    """out [T, H]. rounded=True: mok's rounding points (gate_up, act, y rounded to hidden's dtype, fp32
    combine, one final rounding); rounded=False: everything in fp32 (returns fp32)."""
    dtype = hidden_TH.dtype if rounded else torch.float32
    topk_ids, topk_weights = plain_routes(logits_TE, top_k, renormalize, topk_ids, topk_weights)
    inter = w13_E2IH.shape[1] // 2
    ids = topk_ids.long()
    rows = []
    for t in range(hidden_TH.shape[0]):
        acc = torch.zeros(hidden_TH.shape[1], dtype=torch.float32)
        for k in range(top_k):
            e = int(ids[t, k])
            gate_up = (w13_E2IH[e].float() @ hidden_TH[t].float()).to(dtype)
            act = (F.silu(gate_up[:inter].float()) * gate_up[inter:].float()).to(dtype)
            y = (w2_EHI[e].float() @ act.float()).to(dtype)
            acc = acc + topk_weights[t, k].float() * y.float()
        rows.append(acc)
    return torch.stack(rows).to(dtype)


def plain_moe_grouped(hidden_TH, logits_TE, w13_E2IH, w2_EHI, top_k, renormalize=True, topk_ids=None,
                      topk_weights=None, rounded=True):
    """plain_moe vectorised per expert (fp32 torch matmuls, any device); same rounding points."""
    dtype = hidden_TH.dtype if rounded else torch.float32
    topk_ids, topk_weights = plain_routes(logits_TE, top_k, renormalize, topk_ids, topk_weights)
    num_tokens, hidden = hidden_TH.shape
    inter = w13_E2IH.shape[1] // 2
    flat_ids = topk_ids.reshape(-1).long()
    y_NH = torch.zeros(num_tokens * top_k, hidden, dtype=torch.float32, device=hidden_TH.device)
    for e in range(w13_E2IH.shape[0]):
        slots = (flat_ids == e).nonzero()[:, 0]
        if slots.numel() == 0:
            continue
        gate_up = (hidden_TH[slots // top_k].float() @ w13_E2IH[e].float().t()).to(dtype)
        act = (F.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()).to(dtype)
        y = (act.float() @ w2_EHI[e].float().t()).to(dtype)
        y_NH = y_NH.index_put((slots,), y.float())
    y_TKH = y_NH.view(num_tokens, top_k, hidden)
    acc = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=hidden_TH.device)
    for k in range(top_k):
        acc = acc + topk_weights[:, k:k + 1].float() * y_TKH[:, k]
    return acc.to(dtype)
