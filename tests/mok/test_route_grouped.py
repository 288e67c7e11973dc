"""mok.route_grouped on the CPU reference path: the DeepSeek-V3 / GLM-4.5 routing (docs/contracts.md, "Grouped
routing") against transformers' router, ties, batch invariance, replay, gradients, undefined routing, errors.
(Triton logic: tests/mok/test_route_grouped_interpret.py.)

Against transformers: a plain-torch transcription of DeepseekV3TopkRouter.forward (transformers 5.19,
models/deepseek_v3/modeling_deepseek_v3.py lines 133-158; Glm4MoeTopkRouter is the same code) gives the same ids
and bitwise the same weights when it evaluates the sigmoid and the K-sum as mok does. Where the order of the K-sum
differs (torch's sum, replay in another order) the weights agree within the rounding-error bound of the two sums plus
the division and the scaling, 2 (K + 1) units of 2**-24, relative (SUM_RTOL). transformers' own modules give the same
ids, and weights within that bound plus 8 units (torch's fp32 sigmoid on the CPU is within 2 ulp, not correctly
rounded like mok's, in every score and so in the sum).
"""
from __future__ import annotations

import pytest
import torch

import mok
from mok.errors import UnsupportedError
from mok.ops import dispatch
from mok.ops import grouped_routing as ops
from mok.reference import elementwise
from tests.helpers.bits import same_bits

# name: (num_experts, n_group, topk_group, top_k, scaling): the models' own settings, and an odd group size
SHAPES = {
    "deepseek_v3": (256, 8, 4, 8, 2.5),
    "moonlight": (64, 1, 1, 6, 2.446),
    "glm45": (160, 1, 1, 8, 2.5),  # GLM-4.5 (and -Air, 128 experts) use n_group = topk_group = 1
    "groups_of_20": (160, 8, 3, 8, 2.5),
    "kimi_k2": (384, 1, 1, 8, 2.827),
    "tiny": (8, 4, 2, 3, 1.0),
}


def stable_top(values_TF: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the `count` largest values per row, descending, ties to the lower index (a stable sort)."""
    return torch.sort(values_TF, dim=-1, descending=True, stable=True).indices[:, :count]


def plain_router(logits_TE, bias_E, top_k, n_group, topk_group, renormalize, scaling, *, sigmoid=torch.sigmoid,
                 sequential_sum=False):
    """transformers' DeepseekV3TopkRouter.forward after its linear (lines 136-157), line by line, with
    torch.topk(sorted=False) replaced by stable_top: mok's tie rule and order, which torch leaves unspecified."""
    num_experts = logits_TE.shape[1]
    bias_E = torch.zeros(num_experts) if bias_E is None else bias_E.float()
    scores = sigmoid(logits_TE.float())
    scores_for_choice = scores + bias_E
    group_scores = scores_for_choice.view(-1, n_group, num_experts // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = stable_top(group_scores, topk_group)
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, num_experts // n_group).reshape(-1, num_experts)
    scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    topk_indices = stable_top(scores_for_choice, top_k)
    topk_weights = scores.gather(1, topk_indices)
    if renormalize:
        if sequential_sum:
            total = torch.zeros(topk_weights.shape[0])
            for k in range(top_k):
                total = total + topk_weights[:, k]
            denominator = total[:, None] + 1e-20
        else:
            denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
        topk_weights = topk_weights / denominator
    return topk_indices, topk_weights * scaling


def make_logits(num_tokens: int, num_experts: int, seed: int) -> torch.Tensor:
    """Random logits with special rows: all tied, pairs of ties, -inf, tiny scores (the 1e-20 matters), +inf."""
    logits_TE = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(seed)) * 2
    special = [torch.full((num_experts,), 0.3), torch.arange(num_experts).remainder(5).float(),
               torch.full((num_experts,), -torch.inf), torch.full((num_experts,), -60.0),
               torch.where(torch.arange(num_experts) % 7 == 3, torch.inf, 0.0)]
    for row, values in zip(range(1, num_tokens, 2), special):
        logits_TE[row] = values
    return logits_TE


def make_bias(num_experts: int, seed: int) -> torch.Tensor:
    return torch.randn(num_experts, generator=torch.Generator().manual_seed(seed + 1)) * 0.05


def sum_rtol(top_k: int) -> float:
    """Relative bound between weights whose K-sums ran in different orders: each sum within (K - 1) u of the exact
    one (u = 2**-24), then one rounding each for the division and the scaling, on both sides."""
    return 2 * (top_k + 1) * 2.0**-24


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=0.0, equal_nan=True)


def route(logits_TE, shape, bias_E=None, renormalize=True, **kw):
    num_experts, n_group, topk_group, top_k, scaling = SHAPES[shape]
    return mok.route_grouped(logits_TE, top_k, n_group=n_group, topk_group=topk_group, bias_E=bias_E,
                             renormalize=renormalize, scaling=scaling, **kw)


# ---------------------------------------------------------------------------------------------
# the definition


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("num_tokens", [1, 5, 123])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("renormalize", [True, False])
def test_equals_transformers_formula_bitwise(shape, num_tokens, with_bias, renormalize):
    num_experts, n_group, topk_group, top_k, scaling = SHAPES[shape]
    logits_TE = make_logits(num_tokens, num_experts, num_tokens + num_experts)
    bias_E = make_bias(num_experts, num_tokens) if with_bias else None
    ids_TK, weights_TK = route(logits_TE, shape, bias_E, renormalize)
    assert ids_TK.dtype == torch.int32 and weights_TK.dtype == torch.float32
    assert ids_TK.shape == weights_TK.shape == (num_tokens, top_k)
    expected_ids, expected_weights = plain_router(logits_TE, bias_E, top_k, n_group, topk_group, renormalize, scaling,
                                                  sigmoid=elementwise.sigmoid, sequential_sum=True)
    assert torch.equal(ids_TK.long(), expected_ids)
    assert same_bits(weights_TK, expected_weights)
    # torch's own K-sum order: the same ids, the weights within the bound of two sum orders
    _, torch_sum_weights = plain_router(logits_TE, bias_E, top_k, n_group, topk_group, renormalize, scaling,
                                        sigmoid=elementwise.sigmoid)
    assert_close_rel(weights_TK, torch_sum_weights, sum_rtol(top_k))


@pytest.mark.parametrize("router", ["DeepseekV3TopkRouter", "Glm4MoeTopkRouter"])
@pytest.mark.parametrize("shape", ["deepseek_v3", "moonlight", "glm45", "groups_of_20"])
def test_equals_transformers_modules(router, shape):
    """transformers' own router (its linear an identity, so its logits are ours exactly): the same experts, the
    weights within the two sum orders' bound plus 8 u (torch's CPU sigmoid: within 2 ulp in each score)."""
    transformers = pytest.importorskip("transformers")
    num_experts, n_group, topk_group, top_k, scaling = SHAPES[shape]
    if router == "DeepseekV3TopkRouter":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter as cls
        config_cls = transformers.DeepseekV3Config
    else:
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter as cls
        config_cls = transformers.Glm4MoeConfig
    config = config_cls(hidden_size=num_experts, n_routed_experts=num_experts, num_experts_per_tok=top_k,
                        n_group=n_group, topk_group=topk_group, routed_scaling_factor=scaling, norm_topk_prob=True)
    module = cls(config)
    bias_E = make_bias(num_experts, 7)
    with torch.no_grad():
        module.weight.copy_(torch.eye(num_experts))
        module.e_score_correction_bias.copy_(bias_E)
        logits_TE = torch.randn(123, num_experts, generator=torch.Generator().manual_seed(num_experts)) * 2
        hf_logits, hf_weights, hf_ids = module(logits_TE)
    assert torch.equal(hf_logits, logits_TE)
    ids_TK, weights_TK = route(logits_TE, shape, bias_E)
    assert torch.equal(ids_TK.sort(dim=-1).values.long(), hf_ids.sort(dim=-1).values)
    position_TK = (hf_ids[:, None, :] == ids_TK.long()[:, :, None]).int().argmax(dim=-1)  # ours in theirs
    assert_close_rel(weights_TK, hf_weights.gather(1, position_TK), sum_rtol(top_k) + 8 * 2.0**-24)


def test_ties_go_to_the_lower_group_and_expert():
    # groups of 2: groups 1 and 3 tie for the best score; their 4 experts tie: the lowest 3
    logits_TE = torch.tensor([[0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0],
                              [0.5] * 8,
                              [2.0, 0.0, 0.0, 2.0, 2.0, 0.0, 0.0, 2.0]])
    ids_TK, weights_TK = mok.route_grouped(logits_TE, 3, n_group=4, topk_group=2)
    assert ids_TK.tolist() == [[2, 3, 6], [0, 1, 2], [0, 3, 1]]
    assert torch.equal(weights_TK[1], weights_TK[1, :1].expand(3))  # equal logits, equal weights
    # a permutation of the experts moves the choice with the indices, lowest index first
    flipped_TK, _ = mok.route_grouped(logits_TE.flip(-1), 3, n_group=4, topk_group=2)
    assert flipped_TK.tolist() == [[0, 1, 4], [0, 1, 2], [0, 3, 1]]  # row 2 is a palindrome


def test_groups_are_scored_by_their_two_best_experts():
    # logits -inf: scores 0, so the choice scores are the bias. Group 0: 0.9 + 0.1; group 1: 0.8 + 0.7.
    bias_E = torch.tensor([0.9, 0.1, 0.8, 0.7])
    logits_TE = torch.full((1, 4), -torch.inf)
    ids_TK, weights_TK = mok.route_grouped(logits_TE, 2, n_group=2, topk_group=1, bias_E=bias_E)
    assert ids_TK.tolist() == [[2, 3]]
    assert weights_TK.tolist() == [[0.0, 0.0]]  # unbiased scores 0; 0 / (0 + 1e-20) = 0, not NaN
    ids_TK, _ = mok.route_grouped(logits_TE, 2, n_group=2, topk_group=2, bias_E=bias_E)  # every group kept
    assert ids_TK.tolist() == [[0, 2]]


def test_bias_chooses_but_does_not_weigh():
    logits_TE = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, 0.0]])
    bias_E = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.5])
    ids_TK, weights_TK = mok.route_grouped(logits_TE, 2, bias_E=bias_E, renormalize=False, scaling=2.0)
    assert ids_TK.tolist() == [[5, 4]]  # 0.5 + 0.5 > sigmoid(1) = 0.73
    assert same_bits(weights_TK, elementwise.sigmoid(torch.tensor([[0.0, 1.0]])) * 2.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits_are_widened(dtype):
    logits_TE = make_logits(9, 64, 3).to(dtype)
    bias_E = make_bias(64, 3)
    ids_TK, weights_TK = mok.route_grouped(logits_TE, 6, n_group=4, topk_group=2, bias_E=bias_E.to(dtype))
    ids32_TK, weights32_TK = mok.route_grouped(logits_TE.float(), 6, n_group=4, topk_group=2,
                                               bias_E=bias_E.to(dtype).float())
    assert torch.equal(ids_TK, ids32_TK) and same_bits(weights_TK, weights32_TK)


# ---------------------------------------------------------------------------------------------
# batch invariance and replay


@pytest.mark.parametrize("shape", ["deepseek_v3", "groups_of_20", "moonlight"])
def test_a_row_alone_equals_the_row_in_a_batch(shape):
    num_experts = SHAPES[shape][0]
    logits_TE = make_logits(123, num_experts, 11)
    bias_E = make_bias(num_experts, 11)
    ids_TK, weights_TK = route(logits_TE, shape, bias_E)
    for t in (0, 1, 3, 5, 7, 9, 61, 122):
        ids_alone, weights_alone = route(logits_TE[t:t + 1], shape, bias_E)
        assert torch.equal(ids_alone[0], ids_TK[t]) and same_bits(weights_alone[0], weights_TK[t])
    perm = torch.randperm(123, generator=torch.Generator().manual_seed(2))
    ids_perm, weights_perm = route(logits_TE[perm], shape, bias_E)
    assert torch.equal(ids_perm, ids_TK[perm]) and same_bits(weights_perm, weights_TK[perm])
    ids_pad, weights_pad = route(torch.cat([logits_TE, torch.zeros(5, num_experts)]), shape, bias_E)
    assert torch.equal(ids_pad[:123], ids_TK) and same_bits(weights_pad[:123], weights_TK)


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("renormalize", [True, False])
def test_replay_gives_the_routed_weights(ids_dtype, renormalize):
    logits_TE = make_logits(40, 256, 5)
    bias_E = make_bias(256, 5)
    ids_TK, weights_TK = route(logits_TE, "deepseek_v3", bias_E, renormalize)
    given_TK = ids_TK.to(ids_dtype)
    replay_ids, replay_weights = route(logits_TE, "deepseek_v3", bias_E, renormalize, topk_ids=given_TK)
    assert replay_ids is given_TK and same_bits(replay_weights, weights_TK)
    # other ids (here: a kept group's experts in reverse order): their weights, summed in the given order
    reversed_TK = ids_TK.flip(-1)
    _, reversed_weights = route(logits_TE, "deepseek_v3", bias_E, renormalize, topk_ids=reversed_TK)
    assert_close_rel(reversed_weights.flip(-1), weights_TK, sum_rtol(8))


def test_replay_gradient_equals_the_routed_gradient():
    logits_TE = make_logits(17, 64, 8).requires_grad_()
    grad_TK = torch.randn(17, 6, generator=torch.Generator().manual_seed(9))
    ids_TK, weights_TK = route(logits_TE, "moonlight")
    (routed,) = torch.autograd.grad(weights_TK, logits_TE, grad_TK)
    _, replay_weights = route(logits_TE, "moonlight", topk_ids=ids_TK)
    (replayed,) = torch.autograd.grad(replay_weights, logits_TE, grad_TK)
    assert same_bits(routed, replayed)


# ---------------------------------------------------------------------------------------------
# backward


def plain_weights64(logits_TE, ids_TK, renormalize, scaling):
    """The weights' formula in float64 (transformers' lines 136, 153-157) for autograd."""
    weights_TK = torch.sigmoid(logits_TE).gather(1, ids_TK.long())
    if renormalize:
        weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
    return weights_TK * scaling


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("renormalize", [True, False])
def test_backward_matches_float64_autograd(shape, renormalize):
    num_experts, _, _, top_k, scaling = SHAPES[shape]
    logits_TE = (torch.randn(33, num_experts, generator=torch.Generator().manual_seed(num_experts)) * 2)
    logits_TE.requires_grad_()
    grad_TK = torch.randn(33, top_k, generator=torch.Generator().manual_seed(1))
    ids_TK, weights_TK = route(logits_TE, shape, make_bias(num_experts, 2), renormalize)
    (grad_logits,) = torch.autograd.grad(weights_TK, logits_TE, grad_TK)
    logits64 = logits_TE.detach().double().requires_grad_()
    (expected,) = torch.autograd.grad(plain_weights64(logits64, ids_TK, renormalize, scaling), logits64,
                                      grad_TK.double())
    torch.testing.assert_close(grad_logits.double(), expected, rtol=1e-5, atol=1e-6)
    chosen_TE = torch.zeros_like(logits_TE, dtype=torch.bool).scatter(1, ids_TK.long(), True)
    assert bool((grad_logits[~chosen_TE] == 0).all())  # the bias and the choice carry no gradient
    # run to run, and through the custom op (dispatch off): the same bits; each row its own
    (again,) = torch.autograd.grad(route(logits_TE, shape, make_bias(num_experts, 2), renormalize)[1], logits_TE,
                                   grad_TK)
    assert same_bits(again, grad_logits)
    for t in (0, 32):
        (alone,) = torch.autograd.grad(route(logits_TE[t:t + 1], shape, make_bias(num_experts, 2), renormalize)[1],
                                       logits_TE, grad_TK[t:t + 1])
        assert same_bits(alone[t], grad_logits[t])


def test_direct_calls_and_the_ops_give_the_same_bits(monkeypatch):
    logits_TE = make_logits(12, 160, 4).requires_grad_()
    grad_TK = torch.randn(12, 8, generator=torch.Generator().manual_seed(4))
    bias_E = make_bias(160, 4)
    results = []
    for enabled in (True, False):
        monkeypatch.setattr(dispatch, "ENABLED", enabled)
        ids_TK, weights_TK = route(logits_TE, "groups_of_20", bias_E)
        _, replay_TK = route(logits_TE, "groups_of_20", bias_E, topk_ids=ids_TK)
        results.append((ids_TK, weights_TK, replay_TK, *torch.autograd.grad(weights_TK + replay_TK, logits_TE,
                                                                            grad_TK)))
    assert all(same_bits(a, b) for a, b in zip(*results))


def test_gradient_dtype_follows_the_logits():
    logits_TE = make_logits(6, 64, 1).bfloat16().requires_grad_()
    _, weights_TK = route(logits_TE, "moonlight")
    weights_TK.sum().backward()
    assert logits_TE.grad.dtype == torch.bfloat16


def test_mok_moe_passes_gradients_to_given_weights():
    """Given routes (topk_ids, topk_weights) into mok.moe: d topk_weights flows back, so through route_grouped
    to the logits."""
    gen = torch.Generator().manual_seed(0)
    hidden_TH = torch.randn(5, 32, generator=gen)
    w13_E2IH, w2_EHI = torch.randn(16, 32, 32, generator=gen) * 0.1, torch.randn(16, 32, 16, generator=gen) * 0.1
    logits_TE = torch.randn(5, 16, generator=gen).requires_grad_()
    ids_TK, weights_TK = mok.route_grouped(logits_TE, 4, n_group=4, topk_group=2, scaling=2.5)
    weights_TK.retain_grad()
    out_TH = mok.moe(hidden_TH, logits_TE.detach(), w13_E2IH, w2_EHI, 4, topk_ids=ids_TK, topk_weights=weights_TK)
    out_TH.square().sum().backward()
    assert weights_TK.grad is not None and bool((weights_TK.grad != 0).any())
    (expected,) = torch.autograd.grad(mok.route_grouped(logits_TE, 4, n_group=4, topk_group=2, scaling=2.5)[1],
                                      logits_TE, weights_TK.grad)
    assert same_bits(logits_TE.grad, expected)


# ---------------------------------------------------------------------------------------------
# undefined routing, sizes, errors


def test_undefined_rows_get_nan_weights_and_keep_the_others():
    logits_TE = make_logits(6, 16, 2)
    bias_E = make_bias(16, 2)
    clean_ids, clean_weights = mok.route_grouped(logits_TE, 3, n_group=4, topk_group=2, bias_E=bias_E)
    logits_TE[2, 9] = torch.nan
    logits_TE.requires_grad_()
    ids_TK, weights_TK = mok.route_grouped(logits_TE, 3, n_group=4, topk_group=2, bias_E=bias_E)
    assert ids_TK[2].tolist() == [0, 1, 2] and bool(weights_TK[2].isnan().all())
    keep = [0, 1, 3, 4, 5]
    assert torch.equal(ids_TK[keep], clean_ids[keep]) and same_bits(weights_TK[keep], clean_weights[keep])
    _, replay_TK = mok.route_grouped(logits_TE, 3, n_group=4, topk_group=2, bias_E=bias_E, topk_ids=clean_ids)
    assert bool(replay_TK[2].isnan().all()) and same_bits(replay_TK[keep], clean_weights[keep])
    (grad_TE,) = torch.autograd.grad(weights_TK[keep].sum(), logits_TE)
    assert bool(grad_TE[2].isnan().all()) and bool(grad_TE[keep].isfinite().all())


def test_nan_bias_and_nan_group_scores_are_undefined():
    logits_TE = make_logits(3, 8, 1)
    nan_bias = torch.zeros(8)
    nan_bias[5] = torch.nan
    _, weights_TK = mok.route_grouped(logits_TE, 2, bias_E=nan_bias)
    assert bool(weights_TK.isnan().all())
    # +inf and -inf in one group: its top-2 sum is NaN when groups are scored, and nothing when they are not
    inf_bias = torch.tensor([torch.inf, -torch.inf, 0, 0, 0, 0, 0, 0])
    ids_TK, weights_TK = mok.route_grouped(logits_TE, 2, n_group=4, topk_group=2, bias_E=inf_bias)
    assert ids_TK.tolist() == [[0, 1]] * 3 and bool(weights_TK.isnan().all())
    ids_TK, weights_TK = mok.route_grouped(logits_TE, 2, n_group=4, topk_group=4, bias_E=inf_bias)
    assert ids_TK[:, 0].tolist() == [0, 0, 0] and bool(weights_TK.isfinite().all())


def test_no_tokens():
    ids_TK, weights_TK = mok.route_grouped(torch.zeros(0, 256), 8, n_group=8, topk_group=4)
    assert ids_TK.shape == weights_TK.shape == (0, 8)


BAD = {
    "n_group does not divide E": lambda x: mok.route_grouped(x, 2, n_group=3),
    "n_group 0": lambda x: mok.route_grouped(x, 2, n_group=0),
    "n_group a float": lambda x: mok.route_grouped(x, 2, n_group=2.0),
    "n_group a bool": lambda x: mok.route_grouped(x, 2, n_group=True),
    "topk_group > n_group": lambda x: mok.route_grouped(x, 2, n_group=2, topk_group=3),
    "topk_group 0": lambda x: mok.route_grouped(x, 2, n_group=2, topk_group=0),
    "top_k > kept experts": lambda x: mok.route_grouped(x, 9, n_group=4, topk_group=2),
    "groups of 1 expert": lambda x: mok.route_grouped(x, 2, n_group=16, topk_group=8),
    "top_k > E": lambda x: mok.route_grouped(x, 17),
    "top_k 0": lambda x: mok.route_grouped(x, 0),
    "bias shape": lambda x: mok.route_grouped(x, 2, bias_E=torch.zeros(15)),
    "bias 2-d": lambda x: mok.route_grouped(x, 2, bias_E=torch.zeros(1, 16)),
    "bias int": lambda x: mok.route_grouped(x, 2, bias_E=torch.zeros(16, dtype=torch.int32)),
    "bias fp64": lambda x: mok.route_grouped(x, 2, bias_E=torch.zeros(16, dtype=torch.float64)),
    "bias a list": lambda x: mok.route_grouped(x, 2, bias_E=[0.0] * 16),
    "bias sparse": lambda x: mok.route_grouped(x, 2, bias_E=torch.zeros(16).to_sparse()),
    "scaling inf": lambda x: mok.route_grouped(x, 2, scaling=float("inf")),
    "scaling nan": lambda x: mok.route_grouped(x, 2, scaling=float("nan")),
    "scaling beyond fp32": lambda x: mok.route_grouped(x, 2, scaling=1e39),
    "scaling a tensor": lambda x: mok.route_grouped(x, 2, scaling=torch.tensor(2.5)),
    "renormalize not a bool": lambda x: mok.route_grouped(x, 2, renormalize=1),
    "name not a str": lambda x: mok.route_grouped(x, 2, name=3),
    "logits 1-d": lambda x: mok.route_grouped(x[0], 2),
    "logits int": lambda x: mok.route_grouped(x.int(), 2),
    "logits fp64": lambda x: mok.route_grouped(x.double(), 2),
    "ids out of range": lambda x: mok.route_grouped(x, 2, topk_ids=torch.full((4, 2), 16)),
    "ids shape": lambda x: mok.route_grouped(x, 2, topk_ids=torch.zeros(4, 3, dtype=torch.int64)),
    "ids float": lambda x: mok.route_grouped(x, 2, topk_ids=torch.zeros(4, 2)),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_arguments_raise_unsupported_error(case):
    with pytest.raises(UnsupportedError):
        BAD[case](torch.randn(4, 16))


OPCHECK = {
    "route_grouped": lambda: (ops._route_grouped_op, (make_logits(5, 16, 0).requires_grad_(), make_bias(16, 0), 3,
                                                      4, 2, True, 2.5)),
    "route_grouped_no_bias": lambda: (ops._route_grouped_op, (make_logits(5, 16, 0).requires_grad_(), None, 3, 1, 1,
                                                              False, 1.0)),
    "replay": lambda: (ops._replay_op, (make_logits(5, 16, 0).requires_grad_(), make_bias(16, 0),
                                        torch.tensor([[0, 1, 2]] * 5), 4, 2, True, 2.5)),
    "backward": lambda: (ops._backward_op, (torch.randn(5, 3), make_logits(5, 16, 0), torch.tensor([[0, 1, 2]] * 5),
                                            torch.rand(5, 3), True, 2.5)),
}


@pytest.mark.parametrize("case", sorted(OPCHECK))
def test_opcheck(case):
    """Schema, fake impls, autograd registration and AOT dispatch. opcheck's AOT check sums every output into one
    scalar, which fails on route_grouped's int32 ids (int + float in place): test_torch_compile covers that op."""
    op, args = OPCHECK[case]()
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    if not case.startswith("route_grouped"):
        utils += ("test_aot_dispatch_dynamic",)
    result = torch.library.opcheck(op, args, test_utils=utils)
    assert all(v == "SUCCESS" for v in result.values()), result


def test_torch_compile_keeps_the_eager_bits():
    logits_TE = make_logits(9, 256, 3).requires_grad_()
    bias_E = make_bias(256, 3)
    grad_TK = torch.randn(9, 8, generator=torch.Generator().manual_seed(3))

    def routed(logits, bias):
        ids_TK, weights_TK = route(logits, "deepseek_v3", bias)
        return ids_TK, weights_TK, route(logits, "deepseek_v3", bias, topk_ids=ids_TK)[1]

    results = []
    for fn in (routed, torch.compile(routed, backend="aot_eager", fullgraph=True)):
        ids_TK, weights_TK, replay_TK = fn(logits_TE, bias_E)
        results.append((ids_TK, weights_TK, replay_TK, *torch.autograd.grad(weights_TK + replay_TK, logits_TE,
                                                                            grad_TK)))
    assert all(same_bits(a, b) for a, b in zip(*results))
