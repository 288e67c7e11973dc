"""Undefined routing on the CPU reference path (docs/contracts.md, "Routing"): a token with a NaN or +Inf
router logit, or only -Inf logits, is routed to experts 0..K-1 with NaN weights, its output row is NaN, and
every other token keeps its bits; no error. (CUDA: test_moe_gpu.py; Triton logic: test_moe_interpret.py.)"""
from __future__ import annotations

import pytest
import torch

import mok
from mok.ops.routing import replay_weights
from tests.mok.test_moe import make_inputs

INF = float("inf")
NAN = float("nan")
# how token BAD's logits row is spoiled: (label, function of the row)
SPOILERS = {
    "nan logit": lambda row: row.index_fill(0, torch.tensor([1]), NAN),
    "+inf logit": lambda row: row.index_fill(0, torch.tensor([2]), INF),
    "two +inf logits": lambda row: row.index_fill(0, torch.tensor([0, 3]), INF),
    "all -inf": lambda row: torch.full_like(row, -INF),
    "all nan": lambda row: torch.full_like(row, NAN),
    "nan and +inf": lambda row: row.index_fill(0, torch.tensor([0]), NAN).index_fill(0, torch.tensor([1]), INF),
}
BAD = 2
KEEP = [0, 1, 3, 4, 5, 6]


def spoiled(logits_TE: torch.Tensor, spoiler: str) -> torch.Tensor:
    logits_TE = logits_TE.clone()
    logits_TE[BAD] = SPOILERS[spoiler](logits_TE[BAD])
    return logits_TE


@pytest.mark.parametrize("spoiler", sorted(SPOILERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_sends_undefined_token_to_first_experts_with_nan_weights(spoiler, dtype, renormalize):
    top_k = 3
    logits_TE = spoiled(torch.randn(7, 8, generator=torch.Generator().manual_seed(1)), spoiler).to(dtype)
    ids_TK, weights_TK = mok.route(logits_TE, top_k, renormalize)
    assert ids_TK[BAD].tolist() == [0, 1, 2]
    assert bool(weights_TK[BAD].isnan().all())
    clean_ids, clean_weights = mok.route(logits_TE[KEEP], top_k, renormalize)
    assert torch.equal(ids_TK[KEEP], clean_ids) and torch.equal(weights_TK[KEEP], clean_weights)
    assert not bool(weights_TK[KEEP].isnan().any())
    # replay of the recorded ids recomputes NaN weights for the token, the others' bits
    replayed = replay_weights(logits_TE, ids_TK, renormalize)
    assert bool(replayed[BAD].isnan().all()) and torch.equal(replayed[KEEP], clean_weights)


def test_route_with_inf_logits_that_stay_defined():
    """-Inf logits next to finite ones are fine (probability 0): not undefined."""
    logits_TE = torch.tensor([[0.0, -INF, 1.0, -INF], [-INF, -INF, -INF, 5.0]])
    ids_TK, weights_TK = mok.route(logits_TE, 2)
    assert ids_TK.tolist() == [[2, 0], [3, 0]]
    assert not bool(weights_TK.isnan().any())
    assert weights_TK[1].tolist() == [1.0, 0.0]


@pytest.mark.parametrize("spoiler", sorted(SPOILERS))
@pytest.mark.parametrize("mode", ["route", "replay ids", "replay ids and weights"])
def test_moe_row_of_undefined_token_is_nan_and_others_keep_their_bits(spoiler, mode):
    top_k = 2
    x, logits, w13, w2 = make_inputs(7, 40, 24, 6, seed=4)
    bad_logits = spoiled(logits, spoiler)
    ids_TK, weights_TK = mok.route(bad_logits, top_k)
    kwargs = {"route": {}, "replay ids": {"topk_ids": ids_TK},
              "replay ids and weights": {"topk_ids": ids_TK, "topk_weights": weights_TK}}[mode]
    out = mok.moe(x, bad_logits, w13, w2, top_k, **kwargs)
    clean = mok.moe(x[KEEP], logits[KEEP], w13, w2, top_k)
    assert bool(out[BAD].isnan().all()), out[BAD]
    assert torch.equal(out[KEEP], clean)


def test_moe_with_nan_router_weight_gives_nan_rows_without_error():
    """A NaN router weight makes every logit NaN (vLLM's warm-up feeds such garbage): no crash, NaN rows."""
    layer = mok.MoE(32, 16, 4, 2)
    with torch.no_grad():
        layer.router_weight[0, 0] = NAN
    x = torch.randn(5, 32).bfloat16()
    with torch.no_grad():
        out = layer(x.to(layer.w13.dtype))
    assert out.shape == (5, 32) and bool(out.isnan().all())


def test_undefined_routing_backward_is_nan_on_the_token_only():
    """Gradients flow without error: the bad token's d logits row is NaN, the others' are finite."""
    logits = spoiled(torch.randn(7, 8, generator=torch.Generator().manual_seed(2)), "nan logit").requires_grad_()
    _, weights_TK = mok.route(logits, 2)
    weights_TK.backward(torch.randn(7, 2, generator=torch.Generator().manual_seed(3)))
    assert bool(logits.grad[BAD].isnan().all())
    assert bool(logits.grad[KEEP].isfinite().all())
