"""mok.route_grouped on CUDA (mok/kernels/moe/grouped_routing.py) against the CPU reference (mok/reference/
grouped_routing.py): the same ids and bitwise the same weights and logits gradients, batch invariance, rerun
determinism, and the op through autograd and CUDA graphs. The one allowed difference is the caveat of
tests/mok/test_route_grouped_interpret.py: CUDA's fp64 exp and the reference's may differ in the last fp64 bit, which
moves a score's fp32 rounding with a probability of about 2**-29 per score; these inputs (under 10**7 scores) would
show it in fewer than 2% of runs, and then in one row."""
from __future__ import annotations

import pytest
import torch

import mok
from mok.ops import grouped_routing as ops
from mok.reference import grouped_routing as reference
from tests.helpers.bits import same_bits
from tests.mok.test_route_grouped import SHAPES, make_bias, make_logits

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("num_tokens", [1, 37, 3001])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_kernels_match_the_reference_bitwise(shape, num_tokens):
    num_experts, n_group, topk_group, top_k, scaling = SHAPES[shape]
    logits_TE = make_logits(num_tokens, num_experts, seed=num_tokens)
    grad_TK = torch.randn(num_tokens, top_k, generator=torch.Generator().manual_seed(5))
    for bias_E in (None, make_bias(num_experts, seed=3)):
        bias_cuda = None if bias_E is None else bias_E.cuda()
        for renormalize in (True, False):
            args = (n_group, topk_group, renormalize, scaling)
            ids_TK, weights_TK = ops._route_grouped_cuda(logits_TE.cuda(), bias_cuda, top_k, *args)
            want_ids, want_weights = reference.route_grouped(logits_TE, bias_E, top_k, *args)
            label = (shape, num_tokens, bias_E is not None, renormalize)
            assert torch.equal(ids_TK.cpu(), want_ids), label
            assert same_bits(weights_TK.cpu(), want_weights), label
            assert same_bits(ops._replay_cuda(logits_TE.cuda(), bias_cuda, ids_TK, *args), weights_TK), label
            grad_TE = ops._backward_cuda(grad_TK.cuda(), logits_TE.cuda(), ids_TK, weights_TK, renormalize, scaling)
            want_grad = reference.route_grouped_backward(grad_TK, logits_TE, want_ids, want_weights, renormalize,
                                                         scaling)
            assert same_bits(grad_TE.cpu(), want_grad), label


@pytest.mark.parametrize("shape", ["deepseek_v3", "glm45", "groups_of_20"])
def test_rows_alone_permuted_and_rerun_give_the_batch_bits(shape):
    num_experts, n_group, topk_group, top_k, scaling = SHAPES[shape]
    logits_TE = make_logits(2048, num_experts, seed=11).cuda().to(torch.bfloat16)
    bias_E = make_bias(num_experts, seed=4).cuda()

    def route(x):
        return mok.route_grouped(x, top_k, n_group=n_group, topk_group=topk_group, bias_E=bias_E,
                                 scaling=scaling)

    ids_TK, weights_TK = route(logits_TE)
    for _ in range(3):
        again = route(logits_TE)
        assert torch.equal(again[0], ids_TK) and same_bits(again[1], weights_TK)
    for row in (0, 1, 777, 2047):
        alone = route(logits_TE[row:row + 1])
        assert torch.equal(alone[0], ids_TK[row:row + 1]) and same_bits(alone[1], weights_TK[row:row + 1]), row
    order = torch.randperm(2048, generator=torch.Generator().manual_seed(0)).cuda()
    permuted = route(logits_TE[order])
    assert torch.equal(permuted[0], ids_TK[order]) and same_bits(permuted[1], weights_TK[order])


def test_op_gradient_and_cuda_graph_replay():
    num_experts, n_group, topk_group, top_k, scaling = SHAPES["deepseek_v3"]
    logits_TE = make_logits(300, num_experts, seed=2).cuda().requires_grad_()
    bias_E = make_bias(num_experts, seed=1).cuda()
    kwargs = dict(n_group=n_group, topk_group=topk_group, bias_E=bias_E, scaling=scaling)
    ids_TK, weights_TK = mok.route_grouped(logits_TE, top_k, **kwargs)
    grad_TK = torch.randn(300, top_k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    weights_TK.backward(grad_TK)
    want = reference.route_grouped_backward(grad_TK.cpu(), logits_TE.detach().cpu(), ids_TK.cpu(),
                                            weights_TK.detach().cpu(), True, scaling)
    assert same_bits(logits_TE.grad.cpu(), want)

    static_TE = logits_TE.detach().clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mok.route_grouped(static_TE, top_k, **kwargs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_ids, graph_weights = mok.route_grouped(static_TE, top_k, **kwargs)
    static_TE.copy_(make_logits(300, num_experts, seed=9).cuda())
    graph.replay()
    eager_ids, eager_weights = mok.route_grouped(static_TE, top_k, **kwargs)
    assert torch.equal(graph_ids, eager_ids) and same_bits(graph_weights, eager_weights)
