"""Multi-head Latent Attention's absorbed form on the GPU (docs/contracts.md): mok.attention / mok.paged_attention
with DeepSeek-V3's head (D = 576 query/key features split 512 + 64, W = 512 value features, one key head, the
values a view of the keys) and mok.rotary with YaRN. The bits of a query row on every path (tile configs, packed
vs a latent paged cache, prefill, chunked prefill, decode, CUDA graphs), accuracy against fp32 math, the
backward's determinism. Run on the H200: `pytest -m gpu tests/mok/test_attention_mla_gpu.py`."""

from __future__ import annotations

import pytest
import torch

import mok
from mok.ops.rotary import YarnScaling
from tests.helpers.paged_cache import block_table, slot_mapping

pytestmark = pytest.mark.gpu

Q_HEADS, LATENT, ROPE = 16, 512, 64
HEAD_DIM = LATENT + ROPE
SCALE = 192**-0.5  # transformers' qk_head_dim ** -0.5 (DeepSeek-V3: 128 + 64)
WIDE_CONFIGS = [
    dict(BLOCK_M=32, PACK=1, num_warps=8, num_stages=1),
    dict(BLOCK_M=16, PACK=1, num_warps=4, num_stages=1),
    dict(BLOCK_M=64, PACK=1, num_warps=8, num_stages=1),
    dict(BLOCK_M=32, PACK=16, num_warps=8, num_stages=1),
]


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)


def _latent(lens_k, lens_q=None, seed=0):
    """q [T, Q, 576], kv [S, 1, 576] (kv_c then k_pe) bf16; the values are kv[..., :512]."""
    lens_q = lens_k if lens_q is None else lens_q
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kv_SGD = torch.randn(sum(lens_k), 1, HEAD_DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
    q_TQD = torch.randn(sum(lens_q), Q_HEADS, HEAD_DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
    return q_TQD, kv_SGD


def _latent_cache(kv_SGD, lens, page_size):
    """A latent cache [P, Z, 1, 576] with the keys of each sequence in shuffled pages (NaN elsewhere)."""
    table_BP, num_pages = block_table(lens, page_size, device="cuda")
    cache = torch.full((num_pages * page_size, 1, HEAD_DIM), float("nan"), device="cuda", dtype=kv_SGD.dtype)
    cache[slot_mapping(table_BP, lens, page_size)] = kv_SGD
    return cache.view(num_pages, page_size, 1, HEAD_DIM), table_BP


def test_forward_bits_do_not_depend_on_the_tile():
    from mok.kernels import attention as kernels

    lens = [1, 31, 32, 33, 500, 2100]
    q_TQD, kv_SGD = _latent(lens)
    cu = _cu(lens)
    want, want_lse = kernels.attention_forward(q_TQD, kv_SGD, kv_SGD[..., :LATENT], cu, cu, SCALE, True)
    assert want.shape == (sum(lens), Q_HEADS, LATENT)
    for config in WIDE_CONFIGS:
        out, lse = kernels.attention_forward(q_TQD, kv_SGD, kv_SGD[..., :LATENT], cu, cu, SCALE, True,
                                             config=dict(config))
        assert torch.equal(out, want) and torch.equal(lse, want_lse), config


def test_forward_matches_fp32_math():
    lens = [7, 300, 1100]
    q_TQD, kv_SGD = _latent(lens, seed=1)
    out = mok.attention(q_TQD, kv_SGD, kv_SGD[..., :LATENT], _cu(lens), _cu(lens), SCALE)
    start = 0
    for n in lens:
        q = q_TQD[start : start + n].float().transpose(0, 1)
        k = kv_SGD[start : start + n].float().expand(n, Q_HEADS, HEAD_DIM).transpose(0, 1)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, k[..., :LATENT], is_causal=True, scale=SCALE)
        torch.testing.assert_close(out[start : start + n].float(), want.transpose(0, 1), atol=2e-2, rtol=2e-2)
        start += n


@pytest.mark.parametrize("page_size", [16, 64])
def test_latent_cache_prefill_chunked_prefill_and_decode_equal_the_training_forward(page_size):
    """vLLM's MLA layout: one latent cache, the values its first 512 features. A row through the paged path
    (whole prefill, a chunk, one decode token, decode tiles packing the heads) equals the training forward's."""
    from mok.kernels import attention as kernels

    lens = [1, 2, 33, 64, 65, 1000, 4097]
    q_TQD, kv_SGD = _latent(lens, seed=2)
    cu = _cu(lens)
    train, train_lse = kernels.attention_forward(q_TQD, kv_SGD, kv_SGD[..., :LATENT], cu, cu, SCALE, True)
    cache, table_BP = _latent_cache(kv_SGD, lens, page_size)
    seq_lens = torch.tensor(lens, device="cuda", dtype=torch.int32)
    out, lse = kernels.paged_attention_forward(q_TQD, cache, cache[..., :LATENT], cu, seq_lens, table_BP, SCALE)
    assert torch.equal(out, train) and torch.equal(lse, train_lse)
    for chunk in (1, 5, 300):
        chunk_lens = [min(chunk, n) for n in lens]
        rows = torch.cat([torch.arange(cu[b + 1].item() - c, cu[b + 1].item()) for b, c in enumerate(chunk_lens)])
        for decode in (False, True):
            out, lse = kernels.paged_attention_forward(q_TQD[rows], cache, cache[..., :LATENT], _cu(chunk_lens),
                                                       seq_lens, table_BP, SCALE, decode=decode)
            assert torch.equal(out, train[rows]) and torch.equal(lse, train_lse[rows]), (chunk, decode)


def test_decode_in_a_cuda_graph_replays_the_eager_bits():
    lens = [100, 3000, 1]
    q_TQD, kv_SGD = _latent(lens, seed=3)
    cache, table_BP = _latent_cache(kv_SGD, lens, 64)
    seq_lens = torch.tensor(lens, device="cuda", dtype=torch.int32)
    last = _cu(lens)[1:].long() - 1
    q_BQD, cu_one = q_TQD[last].contiguous(), _cu([1, 1, 1])
    eager = mok.paged_attention(q_BQD, cache, cache[..., :LATENT], cu_one, seq_lens, table_BP, SCALE, decode=True)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mok.paged_attention(q_BQD, cache, cache[..., :LATENT], cu_one, seq_lens, table_BP, SCALE, decode=True)
        with torch.cuda.graph(graph, stream=stream):
            out = mok.paged_attention(q_BQD, cache, cache[..., :LATENT], cu_one, seq_lens, table_BP, SCALE,
                                      decode=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_backward_is_deterministic_and_accurate():
    """Gradients of q and of the latent keys (through both the key and the value view) equal run to run, and
    fp32 autograd's to bf16 accuracy."""
    lens = [1500, 1, 300]
    q_TQD, kv_SGD = _latent(lens, seed=4)
    cu = _cu(lens)
    grad = torch.randn(sum(lens), Q_HEADS, LATENT, device="cuda", dtype=torch.bfloat16)

    def grads():
        q, kv = q_TQD.clone().requires_grad_(), kv_SGD.clone().requires_grad_()
        mok.attention(q, kv, kv[..., :LATENT], cu, cu, SCALE).backward(grad)
        return q.grad, kv.grad

    first = grads()
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(first, grads(), strict=True))
    start = 0
    for n in lens:
        q = q_TQD[start : start + n].float().requires_grad_()
        kv = kv_SGD[start : start + n].float().requires_grad_()
        k = kv.expand(n, Q_HEADS, HEAD_DIM).transpose(0, 1)
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, k[..., :LATENT], is_causal=True,
                                                               scale=SCALE).transpose(0, 1)
        out.backward(grad[start : start + n].float())
        for got, want in zip(first, (q, kv), strict=True):
            got = got[start : start + n].float()
            assert (got - want.grad).abs().max() <= 2e-2 * want.grad.abs().max() + 1e-3
        start += n


@pytest.mark.parametrize("pack", [2, 16])
def test_dq_tiles_packing_heads_are_deterministic_and_accurate(pack):
    """dQ tiles holding PACK heads of a token (one latent key tile read for PACK heads): run to run equal, and
    within bf16 rounding of the default tiles' gradient."""
    from mok.kernels import attention as kernels

    lens = [700, 1, 300]
    q_TQD, kv_SGD = _latent(lens, seed=5)
    cu = _cu(lens)
    out, lse = kernels.attention_forward(q_TQD, kv_SGD, kv_SGD[..., :LATENT], cu, cu, SCALE, True)
    grad = torch.randn_like(out)
    config = dict(kernels.CONFIGS["backward_dq_wide"], BLOCK_M=32, PACK=pack)

    def dq(configs):
        return kernels.attention_backward(grad, q_TQD, kv_SGD, kv_SGD[..., :LATENT], out, lse, cu, cu, SCALE, True,
                                          configs=configs)[0]

    want, got = dq(None), dq({"backward_dq_wide": config})
    assert torch.equal(got, dq({"backward_dq_wide": config}))
    assert (got.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()


def test_yarn_rotary_matches_the_reference_and_its_table_the_formula():
    """DeepSeek-V3's YaRN rope on the GPU: the table's bits equal the per-token formula's at every position
    (inside and past the table), and the CPU reference's within an fp32 ulp of cos/sin (libdevice vs the host)."""
    from mok.kernels import rotary as kernels
    from mok.reference import rotary as reference

    yarn = YarnScaling(40.0, 4096, 32.0, 1.0, 1.2)
    positions = torch.tensor([0, 1, 2, 4095, 4096, 65535, 163839, 200000, 2**24 + 1], device="cuda")
    x = torch.randn(positions.numel(), Q_HEADS, ROPE, device="cuda", dtype=torch.bfloat16)
    for neox in (False, True):
        for inverse in (False, True):
            table = kernels.rotary(x, positions, 10000.0, ROPE, neox, inverse, max_positions=163840, yarn=yarn)
            per_token = kernels.rotary(x, positions, 10000.0, ROPE, neox, inverse, use_table=False, yarn=yarn)
            assert torch.equal(table, per_token), (neox, inverse)
            want = reference.rotary(x.cpu().float(), positions.cpu(), 10000.0, ROPE, neox, inverse, yarn)
            got = kernels.rotary(x.float(), positions, 10000.0, ROPE, neox, inverse, yarn=yarn).cpu()
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
