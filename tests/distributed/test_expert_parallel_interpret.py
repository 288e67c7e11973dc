"""The CUDA side of expert parallelism (mok/kernels/moe/expert_parallel.py: the Triton pieces the
expert-parallel path runs on CUDA tensors) on the CPU: two gloo ranks under TRITON_INTERPRET=1, the
pieces forced onto CPU tensors, against the single-rank Triton layer (mok/kernels/moe/layer.py) over
both ranks' tokens, the same kernels interpreted: outputs and every gradient bitwise. This checks the
launches, the row/expert/rank bookkeeping and the K = 1 cut on the CPU; the tile-shape invariance the
bits rely on on the GPU is proven by the CUDA tests of test_expert_parallel.py and tests/mok/test_moe_gpu.py.
"""
from __future__ import annotations

import functools

import pytest
import torch

from tests.distributed.harness import Cases, check, run_ranks
from tests.distributed.test_expert_parallel import group_inputs, tokens_per_rank
from tests.helpers.bits import same_bits

CASES = Cases()
case = CASES.case


def _equal(got, want, label):
    assert got.shape == want.shape and got.dtype == want.dtype, (label, got.shape, want.shape, got.dtype, want.dtype)
    if not same_bits(got, want):
        diff = (got.float() - want.float()).nan_to_num().abs().max().item() if want.numel() else 0.0
        raise AssertionError(f"{label} differs from the single-rank Triton layer (max |diff| {diff})")


@case
def triton_pieces_equal_the_single_rank_triton_layer(ctx):
    import mok.distributed
    from mok.kernels.moe import layer as kernels

    mok.distributed._KERNELS_ON_CPU = True
    group = torch.distributed.group.WORLD
    size, rank = ctx.world_size, ctx.rank
    for with_empty, (hidden, inter, per_rank, top_k) in ((False, (32, 16, 2, 2)), (True, (40, 24, 3, 3))):
        counts = tokens_per_rank(size, with_empty) if with_empty else [9, 5]
        num_experts = per_rank * size
        x, logits, w13, w2, grad_out = group_inputs(counts, hidden, inter, num_experts, torch.bfloat16, seed=1,
                                                    skew=True)
        ids, weights, _ = kernels.route(logits, top_k, True)
        fwd = kernels.moe_forward(x, w13, w2, ids, weights, True)
        want = kernels.moe_backward(grad_out, x, w13, w2, ids, weights, *fwd[1:])
        start = sum(counts[:rank])
        rows = slice(start, start + counts[rank])
        block = mok.distributed.local_experts(num_experts, group)
        experts = slice(block.start, block.stop)
        leaves = [t.clone().requires_grad_() for t in (x[rows], w13[experts], w2[experts], weights[rows])]
        out = mok.distributed.experts(leaves[0], leaves[1], leaves[2], ids[rows], leaves[3], group, True)
        out.backward(grad_out[rows])
        _equal(out.detach(), fwd[0][rows], "out")
        for label, leaf, expected in zip(("d hidden", "d w13", "d w2", "d weights"), leaves,
                                         (want[0][rows], want[1][experts], want[2][experts], want[3][rows])):
            _equal(leaf.grad, expected, label)


@functools.cache
def _verdicts():
    return run_ranks(__name__, 2, "gloo", timeout=900, env={"TRITON_INTERPRET": "1"})


@pytest.mark.parametrize("name", list(CASES))
def test_triton_pieces_under_interpreter(name):
    pytest.importorskip("triton")
    check(_verdicts(), name)
