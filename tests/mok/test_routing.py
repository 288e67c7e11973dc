"""mok.route on the CPU reference path: the routing definition (docs/contracts.md, "Routing"), ties, batch
invariance, replay, gradients, errors. (CUDA: tests/mok/test_moe_gpu.py; Triton logic:
tests/mok/test_moe_interpret.py.)"""
from __future__ import annotations

import pytest
import torch

import mok
from mok.ops.routing import replay_weights


def plain_route(logits_TE: torch.Tensor, top_k: int, renormalize: bool):
    """The definition in plain torch, fp64; a stable sort of -p puts ties at the lower index."""
    probs_TE = torch.softmax(logits_TE.double(), dim=-1)
    ids_TK = torch.sort(-probs_TE, dim=-1, stable=True).indices[:, :top_k]
    values_TK = probs_TE.gather(1, ids_TK)
    if renormalize:
        values_TK = values_TK / values_TK.sum(dim=-1, keepdim=True)
    return ids_TK, values_TK


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(5, 4, 2), (17, 123, 8), (1, 8, 1), (3, 6, 6)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_matches_definition(dtype, num_tokens, num_experts, top_k, renormalize):
    gen = torch.Generator().manual_seed(num_tokens * 1000 + num_experts)
    logits_TE = (torch.randn(num_tokens, num_experts, generator=gen) * 3).to(dtype)
    ids_TK, weights_TK = mok.route(logits_TE, top_k, renormalize)
    assert ids_TK.dtype == torch.int32 and weights_TK.dtype == torch.float32
    assert ids_TK.shape == weights_TK.shape == (num_tokens, top_k)
    expected_ids, expected_weights = plain_route(logits_TE, top_k, renormalize)
    assert torch.equal(ids_TK.long(), expected_ids)
    torch.testing.assert_close(weights_TK.double(), expected_weights, atol=1e-6, rtol=1e-6)
    # descending order of weight inside each row
    assert bool((weights_TK[:, 1:] <= weights_TK[:, :-1]).all())


def test_ties_go_to_the_lower_expert_index():
    logits_TE = torch.tensor([
        [1.0, 1.0, 1.0, 1.0, 1.0],
        [0.0, 2.0, 0.0, 2.0, 0.0],
        [3.0, 1.0, 3.0, 1.0, 3.0],
        [-1.0, 5.0, 5.0, -1.0, 5.0],
    ])
    ids_TK, weights_TK = mok.route(logits_TE, 3, True)
    assert ids_TK.tolist() == [[0, 1, 2], [1, 3, 0], [0, 2, 4], [1, 2, 4]]
    # equal logits give equal probabilities, hence equal weights
    assert torch.equal(weights_TK[0], torch.full((3,), weights_TK[0, 0].item()))
    # a permutation of the experts moves the choice with the indices, lowest index first
    ids_rev_TK, _ = mok.route(logits_TE.flip(-1), 3, True)
    assert ids_rev_TK.tolist() == [[0, 1, 2], [1, 3, 0], [0, 2, 4], [0, 2, 3]]


def test_weights_renormalize_in_fp32_in_k_order():
    gen = torch.Generator().manual_seed(3)
    logits_TE = torch.randn(9, 16, generator=gen)
    _, raw_TK = mok.route(logits_TE, 4, False)
    _, weights_TK = mok.route(logits_TE, 4, True)
    total_T = ((raw_TK[:, 0] + raw_TK[:, 1]) + raw_TK[:, 2]) + raw_TK[:, 3]
    assert torch.equal(weights_TK, raw_TK / total_T[:, None])


@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (123, 8)])
def test_route_is_batch_invariant_and_deterministic(num_experts, top_k):
    gen = torch.Generator().manual_seed(11)
    logits_TE = torch.randn(300, num_experts, generator=gen)
    ids_TK, weights_TK = mok.route(logits_TE, top_k)
    for row in (0, 7, 299):
        ids_1K, weights_1K = mok.route(logits_TE[row:row + 1], top_k)
        assert torch.equal(ids_1K[0], ids_TK[row]) and torch.equal(weights_1K[0], weights_TK[row])
    perm = torch.randperm(300, generator=gen)
    ids_p, weights_p = mok.route(logits_TE[perm], top_k)
    assert torch.equal(ids_p, ids_TK[perm]) and torch.equal(weights_p, weights_TK[perm])
    again = mok.route(logits_TE, top_k)
    assert torch.equal(again[0], ids_TK) and torch.equal(again[1], weights_TK)


@pytest.mark.parametrize("renormalize", [True, False])
def test_replay_weights_equal_routing(renormalize):
    gen = torch.Generator().manual_seed(5)
    logits_TE = torch.randn(13, 10, generator=gen)
    ids_TK, weights_TK = mok.route(logits_TE, 3, renormalize)
    assert torch.equal(replay_weights(logits_TE, ids_TK, renormalize), weights_TK)
    assert torch.equal(replay_weights(logits_TE, ids_TK.long(), renormalize), weights_TK)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("replay", [False, True])
def test_route_gradient_matches_autograd(renormalize, replay):
    gen = torch.Generator().manual_seed(7)
    logits_TE = torch.randn(6, 9, generator=gen, dtype=torch.float32)
    grad_TK = torch.randn(6, 3, generator=gen)
    logits = logits_TE.clone().requires_grad_()
    ids_TK, weights_TK = mok.route(logits, 3, renormalize)
    if replay:
        weights_TK = replay_weights(logits, ids_TK, renormalize)
    weights_TK.backward(grad_TK)

    logits64 = logits_TE.double().requires_grad_()
    probs = torch.softmax(logits64, dim=-1).gather(1, ids_TK.long())
    if renormalize:
        probs = probs / probs.sum(dim=-1, keepdim=True)
    probs.backward(grad_TK.double())
    torch.testing.assert_close(logits.grad.double(), logits64.grad, atol=1e-6, rtol=1e-5)


def test_route_gradient_keeps_logit_dtype():
    logits = torch.randn(4, 8).bfloat16().requires_grad_()
    _, weights_TK = mok.route(logits, 2)
    weights_TK.sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and logits.grad.shape == (4, 8)


@pytest.mark.parametrize("bad", [
    lambda: mok.route(torch.randn(4, 8), 0),
    lambda: mok.route(torch.randn(4, 8), 9),
    lambda: mok.route(torch.randn(4, 8), 2.0),
    lambda: mok.route(torch.randn(2, 4, 8), 2),
    lambda: mok.route(torch.randint(0, 3, (4, 8)), 2),
    lambda: mok.route(torch.randn(4, 8).double(), 2),
    lambda: replay_weights(torch.randn(4, 8), torch.full((4, 2), 8)),
    lambda: replay_weights(torch.randn(4, 8), torch.zeros(4, 2)),
])
def test_route_rejects_bad_input(bad):
    with pytest.raises(mok.UnsupportedError):
        bad()


def test_route_emits_hooks_when_named():
    seen = []
    with mok.hooks.observe(lambda name, t, kind: seen.append((name, kind, t.shape))):
        mok.route(torch.randn(3, 8), 2, name="layers.0.route")
        mok.route(torch.randn(3, 8), 2)
    assert seen == [("layers.0.route", "input", (3, 8)), ("layers.0.route", "output", (3, 2))]
