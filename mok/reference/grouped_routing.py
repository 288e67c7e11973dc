"""CPU reference of mok.route_grouped: the DeepSeek-V3 / GLM-4.5 routing (docs/contracts.md, "Grouped routing").

Shapes: docs/shapes.md (C: expert groups). The Triton path (mok/kernels/moe/grouped_routing.py) computes the same
with the same rounding points:
  scores  s = sigmoid(fp32 logits)                     fp64 math rounded once to fp32 (elementwise.sigmoid)
  choice  c = s + bias                                 fp32; chooses the experts, never weighs them
  groups  group score = top-1 + top-2 choice score of the group (fp32), only when topk_group < n_group;
          the topk_group best groups are kept, ties to the lower group index
  experts top-k of the kept experts by choice score, ties to the lower expert index, in that order
  weights w = s[ids]; if renormalize w / (sum_k w + 1e-20) (sum in order k = 0..K-1); then w * scaling (fp32)
Undefined routing: a NaN choice score or (group-limited) a NaN group score: experts 0..K-1 (route), NaN weights.

Every selection is an exact max or an exact comparison, the only sums run over k in order, and the sigmoid is
position-independent (mok/reference/elementwise.py), so a row's bits depend only on that row.
"""
from __future__ import annotations

import torch

from mok.reference import elementwise
from mok.reference.reduce import sum_last

EPSILON = 1e-20  # transformers' DeepseekV3TopkRouter / Glm4MoeTopkRouter add it to the sum before dividing


def _fp32(value: float, like: torch.Tensor) -> torch.Tensor:
    """A python float as a 0-d fp32 tensor (rounded to nearest, as torch and Triton round a scalar operand)."""
    return torch.tensor(value, dtype=torch.float32, device=like.device)


def choice_scores(logits_TE: torch.Tensor, bias_E: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores fp32 [T, E], choice scores fp32 [T, E]): sigmoid of the fp32 logits, plus the bias when given."""
    scores_TE = elementwise.sigmoid(logits_TE.float())
    return scores_TE, scores_TE if bias_E is None else scores_TE + bias_E.float()[None, :]


def group_scores(choice_TE: torch.Tensor, n_group: int) -> torch.Tensor:
    """fp32 [T, C]: the sum of each group's two largest choice scores (largest + second largest)."""
    num_tokens, num_experts = choice_TE.shape
    grouped = choice_TE.view(num_tokens, n_group, num_experts // n_group)
    first_TC, second_TC = torch.topk(grouped, 2, dim=-1).values.unbind(-1)
    return first_TC + second_TC  # topk's values are exact whatever its tie order


def top_k_lowest_index(values_TF: torch.Tensor, available_TF: torch.Tensor, count: int) -> torch.Tensor:
    """ids int64 [T, count]: the `count` largest available values of each row, ties to the lower index, in
    selection order. values_TF: no NaN; every row has at least `count` available entries."""
    num_columns = values_TF.shape[1]
    index_F = torch.arange(num_columns, device=values_TF.device)
    ids = []
    for _ in range(count):
        best_T1 = torch.where(available_TF, values_TF, -torch.inf).amax(dim=-1, keepdim=True)
        is_best_TF = available_TF & (values_TF == best_T1)
        idx_T = torch.where(is_best_TF, index_F[None, :], num_columns).amin(dim=-1)
        ids.append(idx_T)
        available_TF = available_TF.scatter(1, idx_T[:, None], False)
    return torch.stack(ids, dim=1)


def weights_of(scores_TE: torch.Tensor, ids_TK: torch.Tensor, renormalize: bool, scaling: float) -> torch.Tensor:
    """fp32 [T, K]: the unbiased scores of ids, divided by (their sum in order k + EPSILON) if renormalize,
    times scaling."""
    weights_TK = scores_TE.gather(1, ids_TK.long())
    if renormalize:
        weights_TK = weights_TK / (sum_last(weights_TK) + _fp32(EPSILON, scores_TE))[:, None]
    return weights_TK * _fp32(scaling, scores_TE)


def _undefined_and_groups(choice_TE: torch.Tensor, n_group: int, grouped: bool):
    """(undefined rows bool [T, 1], group scores fp32 [T, C] or None)."""
    undefined_T1 = torch.isnan(choice_TE).any(dim=-1, keepdim=True)
    if not grouped:
        return undefined_T1, None
    groups_TC = group_scores(choice_TE, n_group)
    return undefined_T1 | torch.isnan(groups_TC).any(dim=-1, keepdim=True), groups_TC


def route_grouped(logits_TE: torch.Tensor, bias_E: torch.Tensor | None, top_k: int, n_group: int, topk_group: int,
                  renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (ids int32 [T, K] in descending choice-score order, weights fp32 [T, K]). Arguments checked by the op."""
    num_tokens, num_experts = logits_TE.shape
    scores_TE, choice_TE = choice_scores(logits_TE, bias_E)
    grouped = topk_group < n_group  # keeping every group keeps every expert: no group step
    undefined_T1, groups_TC = _undefined_and_groups(choice_TE, n_group, grouped)
    # An undefined row selects from zeros (no NaN in the comparisons); its ids are then set to 0..K-1.
    choice_TE = choice_TE.masked_fill(undefined_T1, 0.0)
    available_TE = torch.ones_like(choice_TE, dtype=torch.bool)
    if grouped:
        groups_TC = groups_TC.masked_fill(undefined_T1, 0.0)
        every_group_TC = torch.ones_like(groups_TC, dtype=torch.bool)
        kept_TC = torch.zeros_like(every_group_TC).scatter(
            1, top_k_lowest_index(groups_TC, every_group_TC, topk_group), True)
        available_TE = kept_TC.repeat_interleave(num_experts // n_group, dim=1)
    ids_TK = top_k_lowest_index(choice_TE, available_TE, top_k)
    ids_TK = torch.where(undefined_T1, torch.arange(top_k, device=ids_TK.device)[None, :], ids_TK)
    weights_TK = weights_of(scores_TE, ids_TK, renormalize, scaling).masked_fill(undefined_T1, float("nan"))
    return ids_TK.to(torch.int32), weights_TK


def replay_grouped(logits_TE: torch.Tensor, bias_E: torch.Tensor | None, ids_TK: torch.Tensor, n_group: int,
                   topk_group: int, renormalize: bool, scaling: float) -> torch.Tensor:
    """Weights fp32 [T, K] of given ids (in their given order), as route_grouped computes them; NaN for a row of
    undefined routing. ids are range-checked by the op on the CPU."""
    scores_TE, choice_TE = choice_scores(logits_TE, bias_E)
    undefined_T1, _ = _undefined_and_groups(choice_TE, n_group, topk_group < n_group)
    return weights_of(scores_TE, ids_TK, renormalize, scaling).masked_fill(undefined_T1, float("nan"))


def route_grouped_backward(grad_weights_TK: torch.Tensor, logits_TE: torch.Tensor, ids_TK: torch.Tensor,
                           weights_TK: torch.Tensor, renormalize: bool, scaling: float) -> torch.Tensor:
    """d logits fp32 [T, E] from d weights [T, K] (bias and choice carry none). Rows with NaN weights (undefined
    routing) get a NaN row.

    w_k = c * s_k / D with D = sum_j s_j + eps (renormalize), so ds_k = (c g_k - sum_j c g_j u_j) / D with
    u_j = s_j / D; without renormalize ds_k = c g_k. d logit_e = (sum over k with id_k = e of ds_k) * s_e (1 - s_e).
    Sums in order k = 0..K-1, one scatter-add per k (deterministic, duplicate replayed ids accumulate in k order).
    """
    num_experts, top_k = logits_TE.shape[1], ids_TK.shape[1]
    undefined_T1 = torch.isnan(weights_TK).any(dim=-1, keepdim=True)
    # Replayed ids outside [0, E) (unchecked on CUDA) index experts 0..K-1 as in the forward: no out-of-bounds access.
    out_of_range_T1 = ((ids_TK < 0) | (ids_TK >= num_experts)).any(dim=-1, keepdim=True)
    ids_TK = torch.where(out_of_range_T1, torch.arange(top_k, device=ids_TK.device), ids_TK.long())
    scores_TE = elementwise.sigmoid(logits_TE.float())
    selected_TK = scores_TE.gather(1, ids_TK)
    grad_TK = grad_weights_TK.float() * _fp32(scaling, scores_TE)
    if renormalize:
        total_T1 = (sum_last(selected_TK) + _fp32(EPSILON, scores_TE))[:, None]
        dot_T1 = sum_last(grad_TK * (selected_TK / total_T1))[:, None]
        grad_TK = (grad_TK - dot_T1) / total_T1
    grad_scores_TE = torch.zeros_like(scores_TE)
    for k in range(top_k):
        grad_scores_TE = grad_scores_TE.scatter_add(1, ids_TK[:, k:k + 1], grad_TK[:, k:k + 1])
    grad_logits_TE = grad_scores_TE * (scores_TE * (1.0 - scores_TE))
    return grad_logits_TE.masked_fill(undefined_T1, float("nan"))
