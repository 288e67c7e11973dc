"""Inputs and checks shared by the MoE interpreter cases (tests/mok/test_moe_interpret*.py). The cases run in a
child process under TRITON_INTERPRET=1, so torch and mok are imported inside the functions, as in the case files.
"""
from __future__ import annotations

import contextlib

# (T, H, I, E, K): a tiny shape, odd sizes that exercise every mask, one token, and
# more experts than tokens (empty experts).
SHAPES = [(5, 64, 32, 4, 2), (7, 40, 24, 6, 3), (1, 33, 17, 5, 2), (3, 64, 32, 16, 4)]


def moe_inputs(num_tokens, hidden, inter, num_experts, seed=0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).bfloat16()
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).bfloat16()
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5).bfloat16()
    return x, logits, w13, w2


def assert_close_scaled(actual, expected, label, tol=2e-2):
    import torch

    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (label, actual.shape, expected.shape)
    scale = max(1.0, expected.float().abs().max().item())
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol * scale, rtol=tol, msg=label)


@contextlib.contextmanager
def descriptor_spy():
    """Records (tensor shape, block shape) of every TMA descriptor the kernels build, while active."""
    from mok.kernels.moe import grouped_gemm

    used = []
    original = grouped_gemm._descriptor

    def spy(t2d, block_shape):
        used.append((tuple(t2d.shape), tuple(block_shape)))
        return original(t2d, block_shape)

    grouped_gemm._descriptor = spy
    try:
        yield used
    finally:
        grouped_gemm._descriptor = original


def forward_pair(shape, configs=None, seed=0):
    from mok.kernels.moe import layer as kernels
    from mok.reference import moe as reference

    num_tokens, hidden, inter, num_experts, top_k = shape
    x, logits, w13, w2 = moe_inputs(num_tokens, hidden, inter, num_experts, seed)
    ids, weights, _ = reference.route(logits, top_k, True)
    got = kernels.moe_forward(x, w13, w2, ids, weights, True, configs)
    want = reference.moe_forward(x, w13, w2, ids, weights)
    return got, want, (x, w13, w2, ids, weights)
