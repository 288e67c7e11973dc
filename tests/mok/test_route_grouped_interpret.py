"""The Triton kernels of mok.route_grouped (mok/kernels/moe/grouped_routing.py) under TRITON_INTERPRET=1 on CPU
tensors, against the CPU reference (mok/reference/grouped_routing.py).

The cases run in one child process (this file run as a script, through the `triton_interpret` fixture of
tests/conftest.py) and pytest checks each case's verdict. Ids must be equal and weights and logits gradients bitwise
equal: both paths run the same IEEE operations in the same order (selections are exact maxima, sums run over k in
order, the sigmoid is fp64 math rounded once to fp32). One caveat, not met by these inputs: the interpreter's fp64 exp
(numpy) and the reference's (mok/reference/elementwise.py) may differ in the last fp64 bit, which changes a score's
fp32 rounding with a probability of about 2**-29 per score. The kernels are called through the ops' CUDA functions
(mok/ops/grouped_routing.py), which take CPU tensors here.
"""
from __future__ import annotations

import sys

from tests.helpers.interpret import Cases, interpreter_test, run_cases

CASES = Cases()
case = CASES.case


def _paths():
    """(kernel forward, kernel replay, kernel backward, reference module)."""
    from mok.ops import grouped_routing as ops
    from mok.reference import grouped_routing as reference

    return ops._route_grouped_cuda, ops._replay_cuda, ops._backward_cuda, reference


def _same_bits(a, b) -> bool:
    from tests.helpers.bits import same_bits

    return same_bits(a, b)


def _check_shape(shape: str, num_tokens: int, seed: int) -> None:
    import torch

    from tests.mok.test_route_grouped import SHAPES, make_bias, make_logits

    route, replay, backward, reference = _paths()
    num_experts, n_group, topk_group, top_k, scaling = SHAPES[shape]
    logits_TE = make_logits(num_tokens, num_experts, seed)
    grad_TK = torch.randn(num_tokens, top_k, generator=torch.Generator().manual_seed(seed))
    for bias_E in (None, make_bias(num_experts, seed)):
        for renormalize in (True, False):
            args = (n_group, topk_group, renormalize, scaling)
            ids_TK, weights_TK = route(logits_TE, bias_E, top_k, *args)
            ref_ids, ref_weights = reference.route_grouped(logits_TE, bias_E, top_k, *args)
            assert torch.equal(ids_TK, ref_ids), (shape, ids_TK, ref_ids)
            assert _same_bits(weights_TK, ref_weights), (shape, (weights_TK - ref_weights).abs().max())
            assert _same_bits(replay(logits_TE, bias_E, ids_TK, *args), weights_TK)
            grad_TE = backward(grad_TK, logits_TE, ids_TK, weights_TK, renormalize, scaling)
            ref_grad = reference.route_grouped_backward(grad_TK, logits_TE, ids_TK, weights_TK, renormalize, scaling)
            assert _same_bits(grad_TE, ref_grad), (shape, (grad_TE - ref_grad).abs().max())


# ---------------------------------------------------------------------------------------------
# cases (run in the child)


@case
def deepseek_v3_matches_the_reference():
    _check_shape("deepseek_v3", 11, 1)


@case
def moonlight_matches_the_reference():
    _check_shape("moonlight", 11, 2)


@case
def glm45_matches_the_reference():
    _check_shape("glm45", 11, 3)


@case
def groups_of_20_match_the_reference():
    _check_shape("groups_of_20", 11, 4)


@case
def kimi_k2_matches_the_reference():
    _check_shape("kimi_k2", 5, 5)


@case
def tiny_matches_the_reference():
    _check_shape("tiny", 11, 6)


@case
def one_token_matches_the_reference():
    _check_shape("deepseek_v3", 1, 7)


@case
def ties_go_to_the_lower_group_and_expert():
    import torch

    route, _, _, reference = _paths()
    logits_TE = torch.tensor([[0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0],
                              [0.5] * 8,
                              [2.0, 0.0, 0.0, 2.0, 2.0, 0.0, 0.0, 2.0]])
    ids_TK, _ = route(logits_TE, None, 3, 4, 2, True, 1.0)
    assert ids_TK.tolist() == [[2, 3, 6], [0, 1, 2], [0, 3, 1]], ids_TK
    bias_E = torch.tensor([0.9, 0.1, 0.8, 0.7])  # groups scored by their two best: 0.9 + 0.1 < 0.8 + 0.7
    ids_TK, weights_TK = route(torch.full((1, 4), -torch.inf), bias_E, 2, 2, 1, True, 1.0)
    assert ids_TK.tolist() == [[2, 3]] and weights_TK.tolist() == [[0.0, 0.0]]
    # negative choice scores (a negative bias) order as their values
    bias_E = torch.tensor([-1.0, -0.5, -2.0, -0.25, -3.0, -0.75])
    ids_TK, _ = route(torch.zeros(1, 6), bias_E, 4, 3, 2, True, 1.0)
    assert torch.equal(ids_TK, reference.route_grouped(torch.zeros(1, 6), bias_E, 4, 3, 2, True, 1.0)[0]), ids_TK


@case
def a_row_alone_equals_the_row_in_a_batch():
    import torch

    from tests.mok.test_route_grouped import make_bias, make_logits

    route, _, backward, _ = _paths()
    logits_TE = make_logits(37, 160, 9)
    bias_E = make_bias(160, 9)
    grad_TK = torch.randn(37, 8, generator=torch.Generator().manual_seed(9))
    ids_TK, weights_TK = route(logits_TE, bias_E, 8, 8, 3, True, 2.5)
    grad_TE = backward(grad_TK, logits_TE, ids_TK, weights_TK, True, 2.5)
    for t in (0, 1, 3, 5, 7, 9, 18, 36):
        ids_alone, weights_alone = route(logits_TE[t:t + 1], bias_E, 8, 8, 3, True, 2.5)
        assert torch.equal(ids_alone[0], ids_TK[t]) and _same_bits(weights_alone[0], weights_TK[t]), t
        grad_alone = backward(grad_TK[t:t + 1], logits_TE[t:t + 1], ids_alone, weights_alone, True, 2.5)
        assert _same_bits(grad_alone[0], grad_TE[t]), t
    perm = torch.randperm(37, generator=torch.Generator().manual_seed(10))
    ids_perm, weights_perm = route(logits_TE[perm], bias_E, 8, 8, 3, True, 2.5)
    assert torch.equal(ids_perm, ids_TK[perm]) and _same_bits(weights_perm, weights_TK[perm])


@case
def undefined_routing_and_out_of_range_replay():
    import torch

    from tests.mok.test_route_grouped import make_bias, make_logits

    route, replay, backward, reference = _paths()
    logits_TE = make_logits(6, 16, 2)
    bias_E = make_bias(16, 2)
    clean_ids, clean_weights = route(logits_TE, bias_E, 3, 4, 2, True, 2.5)
    logits_TE[2, 9] = torch.nan
    ids_TK, weights_TK = route(logits_TE, bias_E, 3, 4, 2, True, 2.5)
    assert ids_TK[2].tolist() == [0, 1, 2] and bool(weights_TK[2].isnan().all())
    keep = [0, 1, 3, 4, 5]
    assert torch.equal(ids_TK[keep], clean_ids[keep]) and _same_bits(weights_TK[keep], clean_weights[keep])
    grad_TE = backward(torch.ones(6, 3), logits_TE, ids_TK, weights_TK, True, 2.5)
    assert bool(grad_TE[2].isnan().all()) and bool(grad_TE[keep].isfinite().all())
    # a NaN bias entry: every row; +inf and -inf in one group: a NaN group score (when groups are scored)
    nan_bias = bias_E.clone()
    nan_bias[5] = torch.nan
    assert bool(route(logits_TE, nan_bias, 3, 4, 2, True, 2.5)[1].isnan().all())
    inf_bias = torch.zeros(16)
    inf_bias[0], inf_bias[1:4] = torch.inf, -torch.inf
    for topk_group in (2, 4):
        got = route(logits_TE, inf_bias, 3, 4, topk_group, True, 2.5)
        expected = reference.route_grouped(logits_TE, inf_bias, 3, 4, topk_group, True, 2.5)
        assert torch.equal(got[0], expected[0]) and _same_bits(got[1], expected[1]), topk_group
    # replayed ids outside [0, E) (not checked on the host on CUDA): NaN weights for that row only, int64 ids
    given_TK = clean_ids.long()
    given_TK[4, 1] = 16
    given_TK[5, 0] = -1
    logits_TE[2, 9] = 0.0
    replayed = replay(logits_TE, bias_E, given_TK, 4, 2, True, 2.5)
    assert bool(replayed[4:].isnan().all()) and _same_bits(replayed[:2], clean_weights[:2])
    grad_TE = backward(torch.ones(6, 3), logits_TE, given_TK, replayed, True, 2.5)
    assert bool(grad_TE[4:].isnan().all()) and bool(grad_TE[:4].isfinite().all())


@case
def low_precision_logits_int64_ids_and_no_tokens():
    import torch

    from tests.mok.test_route_grouped import make_bias, make_logits

    route, replay, backward, reference = _paths()
    bias_E = make_bias(64, 3)
    for dtype in (torch.bfloat16, torch.float16):
        logits_TE = make_logits(7, 64, 3).to(dtype)
        ids_TK, weights_TK = route(logits_TE, bias_E, 6, 4, 2, True, 2.446)
        ref_ids, ref_weights = reference.route_grouped(logits_TE, bias_E, 6, 4, 2, True, 2.446)
        assert torch.equal(ids_TK, ref_ids) and _same_bits(weights_TK, ref_weights), dtype
        assert _same_bits(replay(logits_TE, bias_E, ids_TK.long(), 4, 2, True, 2.446), weights_TK)
        grad_TK = torch.randn(7, 6, generator=torch.Generator().manual_seed(1)).to(dtype)
        assert _same_bits(backward(grad_TK, logits_TE, ids_TK.long(), weights_TK, True, 2.446),
                          reference.route_grouped_backward(grad_TK, logits_TE, ids_TK, weights_TK, True, 2.446))
    ids_TK, weights_TK = route(torch.zeros(0, 256), None, 8, 8, 4, True, 2.5)
    assert ids_TK.shape == weights_TK.shape == (0, 8)
    assert backward(torch.zeros(0, 8), torch.zeros(0, 256), ids_TK, weights_TK, True, 2.5).shape == (0, 256)


@case
def duplicate_replayed_ids_accumulate_in_k_order():
    import torch

    from tests.mok.test_route_grouped import make_logits

    route, replay, backward, reference = _paths()
    logits_TE = make_logits(4, 8, 5)
    given_TK = torch.tensor([[1, 1, 2], [0, 3, 0], [7, 7, 7], [4, 5, 6]])
    grad_TK = torch.randn(4, 3, generator=torch.Generator().manual_seed(5))
    weights_TK = replay(logits_TE, None, given_TK, 1, 1, True, 1.5)
    assert _same_bits(weights_TK, reference.replay_grouped(logits_TE, None, given_TK, 1, 1, True, 1.5))
    assert _same_bits(backward(grad_TK, logits_TE, given_TK, weights_TK, True, 1.5),
                      reference.route_grouped_backward(grad_TK, logits_TE, given_TK, weights_TK, True, 1.5))


# ---------------------------------------------------------------------------------------------
# pytest side


test_kernel_logic_under_interpreter = interpreter_test(CASES, __file__)


if __name__ == "__main__":
    sys.exit(run_cases(CASES))
