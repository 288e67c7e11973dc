"""mok.attention on the GPU: the flash kernels' bits (tile configs, TMA, paged vs packed keys, batch
composition, CUDA graphs), the backward's determinism and accuracy. Shapes: docs/shapes.md.
Run on the H200: `pytest -m gpu tests/mok/test_attention_gpu.py`."""

from __future__ import annotations

import pytest
import torch

import mok
from tests.helpers.paged_cache import to_pages

pytestmark = pytest.mark.gpu

Q_HEADS, KV_HEADS, HEAD_DIM = 8, 2, 128


def _kernels():
    from mok.kernels import attention as kernels

    return kernels


def _packed(
    lens_k, lens_q=None, seed=0, dtype=torch.bfloat16, num_q_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM
):
    lens_q = lens_k if lens_q is None else lens_q
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k_SGD = torch.randn(sum(lens_k), num_kv_heads, head_dim, device="cuda", generator=gen, dtype=dtype)
    v_SGD = torch.randn(sum(lens_k), num_kv_heads, head_dim, device="cuda", generator=gen, dtype=dtype)
    q_TQD = torch.randn(sum(lens_q), num_q_heads, head_dim, device="cuda", generator=gen, dtype=dtype)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    return q_TQD, k_SGD, v_SGD, cu_q, cu_k


CONFIG_VARIANTS = [
    dict(BLOCK_M=128, PACK=1, num_warps=8, num_stages=3),
    dict(BLOCK_M=64, PACK=1, num_warps=4, num_stages=2),
    dict(BLOCK_M=16, PACK=1, num_warps=4, num_stages=2),
    dict(BLOCK_M=16, PACK=4, num_warps=4, num_stages=2),
    dict(BLOCK_M=64, PACK=2, num_warps=4, num_stages=3),
    dict(BLOCK_M=128, PACK=4, num_warps=8, num_stages=2),
]


@pytest.mark.parametrize("causal", [True, False])
def test_forward_bits_do_not_depend_on_tile_config_or_tma(causal):
    kernels = _kernels()
    lens = [1, 63, 64, 65, 200, 1000, 3000]
    q_TQD, k_SGD, v_SGD, cu_q, cu_k = _packed(lens)
    scale = HEAD_DIM**-0.5
    want_out, want_lse = kernels.attention_forward(q_TQD, k_SGD, v_SGD, cu_q, cu_k, scale, causal, use_tma=False)
    for config in CONFIG_VARIANTS:
        for tma in (False, True):
            out, lse = kernels.attention_forward(
                q_TQD, k_SGD, v_SGD, cu_q, cu_k, scale, causal, use_tma=tma, config=dict(config)
            )
            assert torch.equal(out, want_out), (config, tma)
            assert torch.equal(lse, want_lse), (config, tma)


def test_forward_matches_fp32_math():
    lens = [5, 300, 1025]
    q_TQD, k_SGD, v_SGD, cu_q, cu_k = _packed(lens)
    out = mok.attention(q_TQD, k_SGD, v_SGD, cu_q, cu_k, HEAD_DIM**-0.5)
    start = 0
    for n in lens:
        q = q_TQD[start : start + n].float().transpose(0, 1)
        k = k_SGD[start : start + n].float().repeat_interleave(Q_HEADS // KV_HEADS, 1).transpose(0, 1)
        v = v_SGD[start : start + n].float().repeat_interleave(Q_HEADS // KV_HEADS, 1).transpose(0, 1)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1)
        torch.testing.assert_close(out[start : start + n].float(), want, atol=2e-2, rtol=2e-2)
        start += n


def test_sequence_alone_equals_inside_batches():
    lens = [700, 1, 4096, 33, 2000]
    q_TQD, k_SGD, v_SGD, cu_q, cu_k = _packed(lens)
    scale = HEAD_DIM**-0.5
    out_TQD = mok.attention(q_TQD, k_SGD, v_SGD, cu_q, cu_k, scale)
    for b, n in enumerate(lens):
        start = cu_q[b].item()
        cu_alone = torch.tensor([0, n], device="cuda", dtype=torch.int32)
        rows = slice(start, start + n)
        alone = mok.attention(q_TQD[rows], k_SGD[rows], v_SGD[rows], cu_alone, cu_alone, scale)
        assert torch.equal(alone, out_TQD[rows]), b


@pytest.mark.parametrize("page_size", [16, 64])
def test_paged_prefill_chunked_prefill_and_decode_equal_the_training_forward(page_size):
    """A row through the paged path (whole prefill, a chunk, one decode token) equals the same row of the
    training forward over packed keys, for sequence lengths 1..32768."""
    kernels = _kernels()
    lens = [1, 2, 17, 64, 65, 1000, 4097, 32768]
    q_TQD, k_SGD, v_SGD, cu_q, cu_k = _packed(lens, seed=3)
    scale = HEAD_DIM**-0.5
    train_TQD, train_lse = kernels.attention_forward(q_TQD, k_SGD, v_SGD, cu_q, cu_k, scale, True)
    key_cache, value_cache, table_BP = to_pages(k_SGD, v_SGD, lens, page_size)
    seq_lens = torch.tensor(lens, device="cuda", dtype=torch.int32)

    out, lse = kernels.paged_attention_forward(q_TQD, key_cache, value_cache, cu_q, seq_lens, table_BP, scale)
    assert torch.equal(out, train_TQD) and torch.equal(lse, train_lse)

    for chunk in (1, 7, 300):  # the last `chunk` queries of each sequence (decode when chunk == 1)
        chunk_lens = [min(chunk, n) for n in lens]
        rows = torch.cat([torch.arange(cu_k[b + 1].item() - c, cu_k[b + 1].item()) for b, c in enumerate(chunk_lens)])
        cu_chunk = torch.tensor([0, *torch.tensor(chunk_lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
        for decode in (False, True):
            out, lse = kernels.paged_attention_forward(
                q_TQD[rows], key_cache, value_cache, cu_chunk, seq_lens, table_BP, scale, decode=decode
            )
            assert torch.equal(out, train_TQD[rows]), (chunk, decode)
            assert torch.equal(lse, train_lse[rows]), (chunk, decode)


def test_cuda_graph_replays_the_eager_bits():
    """mok.attention (training forward), mok.write_kv_cache and mok.paged_attention (decode) captured in one
    CUDA graph: no host synchronisation inside, and the replay gives the eager bits."""
    lens = [100, 4096, 1]
    q_TQD, k_SGD, v_SGD, cu_q, cu_k = _packed(lens, seed=5)
    key_cache, value_cache, table_BP = to_pages(k_SGD, v_SGD, lens, 16)
    seq_lens = torch.tensor(lens, device="cuda", dtype=torch.int32)
    last = (cu_k[1:] - 1).long()
    q_decode, k_new, v_new = q_TQD[last].clone(), k_SGD[last].clone(), v_SGD[last].clone()
    slots = (
        table_BP[torch.arange(len(lens), device="cuda"), (seq_lens.long() - 1) // 16].long() * 16
        + (seq_lens.long() - 1) % 16
    )
    cu_decode = torch.arange(len(lens) + 1, device="cuda", dtype=torch.int32)
    scale = HEAD_DIM**-0.5

    def step():
        mok.write_kv_cache(k_new, v_new, key_cache, value_cache, slots)
        decode = mok.paged_attention(
            q_decode, key_cache, value_cache, cu_decode, seq_lens, table_BP, scale, decode=True
        )
        return mok.attention(q_TQD, k_SGD, v_SGD, cu_q, cu_k, scale), decode

    eager = step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])
    assert torch.equal(eager[1], mok.attention(q_TQD, k_SGD, v_SGD, cu_q, cu_k, scale)[last])


def test_backward_is_deterministic_and_accurate():
    lens = [3000, 1, 700]
    q_TQD, k_SGD, v_SGD, cu_q, cu_k = _packed(lens, seed=7)
    scale = HEAD_DIM**-0.5
    grad = torch.randn_like(q_TQD)

    def grads():
        leaves = [t.clone().requires_grad_() for t in (q_TQD, k_SGD, v_SGD)]
        mok.attention(*leaves, cu_q, cu_k, scale).backward(grad)
        return [t.grad for t in leaves]

    first = grads()
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(first, grads(), strict=True))
    start = 0
    group = Q_HEADS // KV_HEADS
    for n in lens:
        q, k, v = (t[start : start + n].float().requires_grad_() for t in (q_TQD, k_SGD, v_SGD))
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.repeat_interleave(group, 1).transpose(0, 1),
            v.repeat_interleave(group, 1).transpose(0, 1),
            is_causal=True,
            scale=scale,
        ).transpose(0, 1)
        out.backward(grad[start : start + n].float())
        for got, want in zip(first, (q, k, v), strict=True):
            got = got[start : start + n].float()
            assert (got - want.grad).abs().max() <= 2e-2 * want.grad.abs().max() + 1e-3
        start += n


def test_backward_memory_is_linear_at_32k_tokens():
    q_TQD, k_SGD, v_SGD, cu_q, cu_k = _packed([32768], seed=9, num_q_heads=32, num_kv_heads=4)
    leaves = [t.requires_grad_() for t in (q_TQD, k_SGD, v_SGD)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    mok.attention(*leaves, cu_q, cu_k, HEAD_DIM**-0.5).backward(torch.ones_like(q_TQD))
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    # a dense [Q, L, L] fp32 score matrix alone would be 32 * 32768**2 * 4 bytes = 128 GiB
    assert extra < 8 * q_TQD.numel() * q_TQD.element_size(), extra
