"""Triton kernel logic of the dense ops, run on the CPU under TRITON_INTERPRET=1.

The cases run in one child process (this file run as a script, through the `triton_interpret` fixture of
tests/conftest.py) and pytest checks each case's verdict. Triton 3.9's interpreter mishandles bf16
(tl.dot on bf16 operands returns garbage, casts to bf16 truncate), so these cases use fp16 and fp32;
bf16 runs on the GPU tests (test_dense_gpu.py).
"""
from __future__ import annotations

import sys

import torch

from tests.helpers.interpret import Cases, interpreter_test, run_cases
from tests.helpers.paged_cache import to_pages

CASES = Cases()
DTYPES = [torch.float16, torch.float32]
TOL = {torch.float16: dict(atol=2e-3, rtol=2e-3), torch.float32: dict(atol=2e-5, rtol=2e-5)}


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def linear_kernel(shape, dtype):
    from mok.kernels import linear as linear_kernels

    t, k, n = shape
    x, w = _randn(t, k, dtype=dtype), _randn(n, k, dtype=dtype, seed=1, scale=k**-0.5)
    b = _randn(n, dtype=dtype, seed=2)
    out = linear_kernels.linear(x, w, b)
    expected = (x.double() @ w.double().t() + b.double()).to(dtype)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected.double(), **TOL[dtype])
    for i in (0, t - 1):
        assert torch.equal(linear_kernels.linear(x[i : i + 1], w, b)[0], out[i])


CASES.parametrize(linear_kernel, shape=[(70, 50, 33), (1, 16, 130)], dtype=DTYPES)


@CASES.case
def matmul_tma_loads_equal_pointer_loads():
    """The large config's TMA descriptors, over operands stored as they are read (the forward's x) and
    transposed (the forward's w, the weight gradient's d y), give the bits of pointer loads of the same tiles,
    and misaligned or fp32 operands fall back to pointers."""
    from mok.kernels import linear as linear_kernels

    tma = dict(linear_kernels.CONFIGS["large"], BLOCK_M=32, BLOCK_N=32, BLOCK_K=16)
    pointers = dict(tma, TMA=0)
    x, w, g = _randn(70, 48, dtype=torch.float16), _randn(40, 48, dtype=torch.float16, seed=1), \
        _randn(70, 40, dtype=torch.float16, seed=2)
    odd = _randn(70, 47, dtype=torch.float16, seed=3)  # rows of 94 bytes: no TMA
    # forward, d x, d w, a view with 47 of 48 columns (TMA, the box clipped), misaligned rows (pointers)
    for a, b in ((x, w.t()), (g, w), (g.t(), x), (x[:, :47], w[:, :47].t()), (odd, w[:, :47].t())):
        got = linear_kernels.matmul(a, b, config=tma)
        assert torch.equal(got, linear_kernels.matmul(a, b, config=pointers))
        torch.testing.assert_close(got.double(), (a.double() @ b.double()).half().double(), **TOL[torch.float16])
    assert linear_kernels._tma_operand(x, 32, 16)[0] == linear_kernels.LOAD_TMA
    assert linear_kernels._tma_operand(w.t(), 16, 32)[0] == linear_kernels.LOAD_TMA_T
    assert linear_kernels._tma_operand(odd, 32, 16)[0] == linear_kernels.LOAD_POINTER
    assert linear_kernels._tma_operand(x[:1].expand(70, 48), 32, 16)[0] == linear_kernels.LOAD_POINTER
    assert linear_kernels._tma_operand(x.float(), 32, 16)[0] == linear_kernels.LOAD_POINTER


@CASES.case
def batched_strided_matmul():
    from mok.kernels import linear as linear_kernels

    a, b = _randn(3, 7, 40), _randn(3, 11, 40, seed=1)
    out = linear_kernels.matmul(a, b.transpose(1, 2), out_dtype=torch.float32)
    torch.testing.assert_close(out.double(), a.double() @ b.double().transpose(1, 2), atol=2e-5, rtol=2e-5)


@CASES.case
def head_linear_kernel_is_each_heads_linear():
    """One launch over the heads, weights a strided view (MLA's W_UK), output [T, Q, O] written through its strides:
    each head the bits of the linear kernel alone, forward and backward (its own launches' d x and d w)."""
    from mok.kernels import linear as linear_kernels

    x, g = _randn(9, 3, 40, dtype=torch.float16), _randn(9, 3, 24, dtype=torch.float16, seed=2)
    w = _randn(3, 40, 27, dtype=torch.float16, seed=1, scale=40**-0.5)[..., :24].transpose(1, 2)
    out = linear_kernels.head_linear(x, w)
    grad_x, grad_w = linear_kernels.head_linear_backward(g, x, w)
    for h in range(3):
        assert torch.equal(out[:, h], linear_kernels.linear(x[:, h], w[h], None))
        assert torch.equal(grad_x[:, h], linear_kernels.bmm_nt(g[None, :, h], w[h].t()[None], torch.float16)[0])
        assert torch.equal(grad_w[h], linear_kernels.bmm_nt(g[:, h].t()[None], x[:, h].t()[None], torch.float16)[0])
    torch.testing.assert_close(out.double(), torch.einsum("tqf,qof->tqo", x.double(), w.double()).half().double(),
                               **TOL[torch.float16])


def rms_norm_kernel(dtype, with_residual, shape):
    """Short rows share a program (a tile of ROWS rows: 9 rows in one, 150 over three with a partial last one),
    long rows have one each (300 features); strided rows; each row's bits whatever the rows around it."""
    from mok.kernels import rms_norm as rms_norm_kernels
    from mok.reference import rms_norm as rms_norm_reference

    rows, features = shape
    x = _randn(rows, features + 3, dtype=dtype, scale=3)[:, 2:2 + features]
    r, w = _randn(rows, features, dtype=dtype, seed=1), _randn(features, dtype=dtype, seed=2)
    y, new_r = rms_norm_kernels.rms_norm(x, r if with_residual else None, w, 1e-6)
    if with_residual:
        y_ref, r_ref = rms_norm_reference.fused_add_rms_norm(x, r, w, 1e-6)
        assert torch.equal(new_r, r_ref)
    else:
        y_ref = rms_norm_reference.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(y.double(), y_ref.double(), **TOL[dtype])
    for first, last in ((4, 5), (rows - 1, rows), (1, rows - 1)):
        alone = rms_norm_kernels.rms_norm(x[first:last].contiguous(), r[first:last] if with_residual else None, w,
                                          1e-6)
        assert torch.equal(alone[0], y[first:last])


CASES.parametrize(rms_norm_kernel, dtype=DTYPES, with_residual=[False, True], shape=[(9, 45), (150, 45), (7, 300)])


@CASES.case
def rms_norm_short_rows_share_programs():
    from mok.kernels import rms_norm as rms_norm_kernels

    rows = [rms_norm_kernels.rms_norm_forward_config(f)["ROWS"] for f in (45, 128, 256, 257, 2048)]
    assert rows == [64, 32, 16, 1, 1]


def rotary_kernel(dtype, neox, rotary_dim, inverse):
    from mok.kernels import rotary as rotary_kernels
    from mok.reference import rotary as rotary_reference

    x = _randn(5, 3, 20, dtype=dtype)
    pos = torch.randint(0, 5000, (5,), generator=torch.Generator().manual_seed(3))
    out = rotary_kernels.rotary(x, pos, 1e4, rotary_dim, neox, inverse)
    expected = rotary_reference.rotary(x, pos, 1e4, rotary_dim, neox, inverse)
    torch.testing.assert_close(out.double(), expected.double(), **TOL[dtype])
    assert torch.equal(out[:, :, rotary_dim:], x[:, :, rotary_dim:])
    assert torch.equal(rotary_kernels.rotary(x[2:3], pos[2:3], 1e4, rotary_dim, neox, inverse)[0], out[2])


CASES.parametrize(rotary_kernel, dtype=DTYPES, neox=[True, False], rotary_dim=[20, 12], inverse=[False, True])


def silu_and_mul_kernel(dtype):
    from mok.kernels import silu_and_mul as silu_kernels
    from mok.reference import silu_and_mul as silu_reference

    x = _randn(6, 70, dtype=dtype, scale=4)
    out = silu_kernels.silu_and_mul(x)
    torch.testing.assert_close(out.double(), silu_reference.silu_and_mul(x).double(), **TOL[dtype])
    assert torch.equal(silu_kernels.silu_and_mul(x[3:4])[0], out[3])


CASES.parametrize(silu_and_mul_kernel, dtype=DTYPES)


def logprobs_kernels(dtype, v):
    from mok.kernels import logprobs as logprobs_kernels
    from mok.reference import logprobs as logprobs_reference

    x = _randn(4, v, dtype=dtype, scale=4)
    ids = torch.randint(0, v, (4,), generator=torch.Generator().manual_seed(5))
    out = logprobs_kernels.log_softmax(x)
    torch.testing.assert_close(out.double(), logprobs_reference.log_softmax(x).double(), atol=1e-5, rtol=1e-5)
    picked = logprobs_kernels.logprobs(x, ids)
    assert torch.equal(picked, out.gather(1, ids[:, None])[:, 0])
    assert torch.equal(logprobs_kernels.log_softmax(x[2:3])[0], out[2])


CASES.parametrize(logprobs_kernels, dtype=DTYPES, v=[5000, 37])


def rms_norm_backward_kernel(dtype, layout, residual, programs):
    """The backward kernels of mok.rms_norm (plain, fused with a residual gradient of x's dtype or of another)
    against the torch expression, special values and strides included (tests/helpers/torch_backwards.py's
    check_rms_norm_backward); `programs` caps the row programs, so that programs take several rows and the
    column sum several steps."""
    from mok.kernels import rms_norm as rms_norm_kernels

    saved = rms_norm_kernels.BACKWARD_MAX_PROGRAMS, rms_norm_kernels.COLUMN_SUM
    rms_norm_kernels.BACKWARD_MAX_PROGRAMS = programs
    rms_norm_kernels.COLUMN_SUM = dict(saved[1], BLOCK_P=2, BLOCK_C=16)
    try:
        _rms_norm_backward_case(rms_norm_kernels.rms_norm_backward, dtype, layout, residual)
    finally:
        rms_norm_kernels.BACKWARD_MAX_PROGRAMS, rms_norm_kernels.COLUMN_SUM = saved


def _rms_norm_backward_case(kernel_backward, dtype, layout, residual):
    from tests.helpers import torch_backwards

    rows, features = 9, 37
    if layout == "transposed":
        x = _randn(features, rows, dtype=dtype, scale=3).t()
    elif layout == "row_stride":
        x = _randn(rows, features + 11, dtype=dtype, scale=3)[:, 5:5 + features]
    else:
        x = _randn(rows, features, dtype=dtype, scale=3)
    x = x.clone() if layout == "contiguous" else x
    x[2, 0] = 0.0
    other = torch.float32 if dtype != torch.float32 else torch.float16
    inputs = torch_backwards.rms_norm_backward_inputs(_randn, rows, features, dtype, residual, other)
    grad, weight, grad_residual, residual_dtype = inputs
    torch_backwards.check_rms_norm_backward(kernel_backward, grad, x, weight, grad_residual, residual_dtype, TOL)


CASES.parametrize(rms_norm_backward_kernel, dtype=DTYPES, layout=["contiguous", "transposed", "row_stride"],
                  residual=["none", "same", "other"], programs=[1024, 4])


def silu_and_mul_backward_kernel(dtype):
    """mok.silu_and_mul's backward kernel against the reference formula, rounded once; a row's gradient is
    that row's alone."""
    from mok.kernels import silu_and_mul as silu_kernels
    from mok.reference import silu_and_mul as silu_reference

    x = _randn(7, 2 * 37, dtype=dtype, scale=3)
    grad = _randn(7, 37, dtype=dtype, seed=1)
    grad[1, :3] = torch.tensor([0.0, float("nan"), float("inf")])
    got = silu_kernels.silu_and_mul_backward(grad, x)
    assert got.dtype == dtype and got.shape == x.shape
    want = silu_reference.silu_and_mul_backward(grad, x).to(dtype)
    torch.testing.assert_close(got.double(), want.double(), equal_nan=True, **TOL[dtype])
    assert torch.equal(silu_kernels.silu_and_mul_backward(grad[4:5], x[4:5])[0], got[4])
    # any layout (a last dim of stride other than 1 is copied first): the same bits
    from tests.helpers.bits import same_bits

    strided_x = torch.stack([x, x], -1)[..., 0]
    assert strided_x.stride(-1) == 2
    assert same_bits(silu_kernels.silu_and_mul_backward(grad.t().contiguous().t(), strided_x), got)


CASES.parametrize(silu_and_mul_backward_kernel, dtype=DTYPES)


def logprobs_backward_kernel_gives_the_torch_bits(dtype, v):
    """mok.logprobs' CUDA backward kernel gives every bit of the torch steps it replaced (with the interpreter's exp),
    for zero, signed-zero and NaN (an out-of-range id's) gradients too."""
    from tests.helpers import torch_backwards

    logits = _randn(6, v, dtype=dtype, scale=4)
    logits[1, 3] = float("-inf")
    grad = _randn(6, seed=1)
    grad[2], grad[3] = 0.0, -0.0
    ids = torch.randint(0, v, (6,), generator=torch.Generator().manual_seed(5))
    ids[4], ids[5] = v, -2
    got = torch_backwards.assert_logprobs_backward_bits(logits, grad, ids)
    assert bool(got[4:].isnan().all()) and not bool(got[:4].isnan().any())


CASES.parametrize(logprobs_backward_kernel_gives_the_torch_bits, dtype=DTYPES, v=[5000, 37])


def attention_kernel_matches_reference(dtype, causal):
    from mok.kernels import attention as attention_kernels
    from mok.reference import attention as attention_reference

    lens_q, lens_k = [3, 1, 70, 0], [5, 80, 70, 2]
    q = _randn(sum(lens_q), 4, 16, dtype=dtype)
    k, v = _randn(sum(lens_k), 2, 16, dtype=dtype, seed=1), _randn(sum(lens_k), 2, 16, dtype=dtype, seed=2)
    out, lse = attention_kernels.attention_forward(q, k, v, _cu(lens_q), _cu(lens_k), 0.25, causal)
    out_ref, lse_ref = attention_reference.attention_forward(q, k, v, _cu(lens_q), _cu(lens_k), 0.25, causal)
    torch.testing.assert_close(out.double(), out_ref.double(), **TOL[dtype])
    torch.testing.assert_close(lse, lse_ref, atol=1e-5, rtol=1e-5)


CASES.parametrize(attention_kernel_matches_reference, dtype=DTYPES, causal=[True, False])


@CASES.case
def attention_kernel_prefill_chunked_decode_bitwise():
    """The key-loop logic: a tile running past a query's last key leaves it unchanged. The
    interpreter's tl.dot is numpy's BLAS matmul, whose rows depend on their position in the tile,
    so here each query keeps its tile row (0 for decode: queries 0 and 64); the GPU tests check
    every query at every tile position."""
    from mok.kernels import attention as attention_kernels

    tiles = dict(config=dict(BLOCK_M=64, PACK=1, num_warps=4, num_stages=2))  # query 64 starts a tile
    length = 70
    q = _randn(length, 4, 16, dtype=torch.float16)
    k, v = _randn(length, 2, 16, dtype=torch.float16, seed=1), _randn(length, 2, 16, dtype=torch.float16, seed=2)
    full, full_lse = attention_kernels.attention_forward(q, k, v, _cu([length]), _cu([length]), 0.25, True, **tiles)
    for i in (0, 64):
        one, one_lse = attention_kernels.attention_forward(q[i : i + 1], k[: i + 1], v[: i + 1], _cu([1]), _cu([i + 1]),
                                                           0.25, True, **tiles)
        assert torch.equal(one[0], full[i]) and torch.equal(one_lse[0], full_lse[i])
    # queries 64..69 as a chunk whose tile also covers the keys after each query's last one
    chunk, chunk_lse = attention_kernels.attention_forward(q[64:], k, v, _cu([6]), _cu([length]), 0.25, True, **tiles)
    assert torch.equal(chunk, full[64:]) and torch.equal(chunk_lse, full_lse[64:])
    # a two-sequence batch: the second sequence's rows sit at the same tile rows as alone
    both, _ = attention_kernels.attention_forward(torch.cat([q[:3], q]), torch.cat([k[:3], k]), torch.cat([v[:3], v]),
                                                  _cu([3, length]), _cu([3, length]), 0.25, True, **tiles)
    assert torch.equal(both[3:], full)


def attention_kernel_paged_equals_packed(dtype, page_size):
    """Keys through a block table give the bits of packed keys (same tiles); the decode tiles (a GQA group's
    heads packed into one tile) agree to rounding here and bitwise on the GPU (numpy's BLAS is not
    tile-invariant, the H200 is: tests/mok/test_attention_gpu.py)."""
    from mok.kernels import attention as attention_kernels

    lens_q, lens_k = [5, 1, 1, 3], [5, 130, 64, 70]
    q = _randn(sum(lens_q), 4, 16, dtype=dtype)
    k, v = _randn(sum(lens_k), 2, 16, dtype=dtype, seed=1), _randn(sum(lens_k), 2, 16, dtype=dtype, seed=2)
    key_cache, value_cache, table_BP = to_pages(k, v, lens_k, page_size)
    seq_lens = torch.tensor(lens_k, dtype=torch.int32)
    packed, packed_lse = attention_kernels.attention_forward(q, k, v, _cu(lens_q), _cu(lens_k), 0.25, True)
    paged, paged_lse = attention_kernels.paged_attention_forward(q, key_cache, value_cache, _cu(lens_q), seq_lens,
                                                                 table_BP, 0.25)
    assert torch.equal(paged, packed) and torch.equal(paged_lse, packed_lse)
    decode, _ = attention_kernels.paged_attention_forward(q, key_cache, value_cache, _cu(lens_q), seq_lens, table_BP,
                                                          0.25, decode=True)
    torch.testing.assert_close(decode.double(), packed.double(), **TOL[dtype])


CASES.parametrize(attention_kernel_paged_equals_packed, dtype=DTYPES, page_size=[16, 64])


def attention_kernel_backward_matches_reference(dtype, causal):
    from mok.kernels import attention as attention_kernels
    from mok.reference import attention as attention_reference

    lens_q, lens_k = [3, 1, 150, 0], [5, 80, 150, 2]
    q = _randn(sum(lens_q), 4, 16, dtype=dtype)
    k, v = _randn(sum(lens_k) + 2, 2, 16, dtype=dtype, seed=1), _randn(sum(lens_k) + 2, 2, 16, dtype=dtype, seed=2)
    grad = _randn(sum(lens_q), 4, 16, dtype=dtype, seed=3)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    out, lse = attention_kernels.attention_forward(q, k, v, cu_q, cu_k, 0.25, causal)
    got = attention_kernels.attention_backward(grad, q, k, v, out, lse, cu_q, cu_k, 0.25, causal)
    want = attention_reference.attention_backward(grad, q, k, v, out, lse, cu_q, cu_k, 0.25, causal)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w.double(), atol=5e-3 if dtype == torch.float16 else 1e-5, rtol=1e-2)
    assert torch.equal(got[1][-2:], torch.zeros_like(got[1][-2:]))  # keys of no sequence
    again = attention_kernels.attention_backward(grad, q, k, v, out, lse, cu_q, cu_k, 0.25, causal)
    assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True))


CASES.parametrize(attention_kernel_backward_matches_reference, dtype=DTYPES, causal=[True, False])


def attention_kernel_backward_tma_equals_pointer_loads(causal):
    """The backward's descriptor loads (q and d out of whole query tiles for dK/dV, k and v of whole key tiles
    for dQ) read the tiles the pointer loads read: equal gradients, also for q, k, v as strided views of one
    packed qkv projection (TMA over rows of any 16-byte stride), a q TMA cannot read (odd row stride) and a strided
    d out."""
    from mok.kernels import attention as attention_kernels

    lens = [3, 150, 40]  # with BLOCK_M 32 / BLOCK_N 16: diagonal, whole and past-the-end tiles
    heads, kv_heads, head_dim = 4, 2, 16
    qkv = _randn(sum(lens), (heads + 2 * kv_heads) * head_dim, dtype=torch.float16).view(sum(lens), -1, head_dim)
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    grad = _randn(sum(lens), heads, head_dim, dtype=torch.float16, seed=3)
    odd_q = torch.cat([q.new_zeros(sum(lens), 1), q.reshape(sum(lens), -1)], 1)[:, 1:].view(q.shape)
    cu = _cu(lens)
    out, lse = attention_kernels.attention_forward(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, 0.25,
                                                   causal)
    assert attention_kernels._rows_descriptor(q, 32) is not None and attention_kernels._rows_descriptor(odd_q, 32) \
        is None

    def backward(tma, g, q, k, v):
        configs = {"backward_dkdv": dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=2, TMA=tma),
                   "backward_dq": dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=2, TMA=tma)}
        return attention_kernels.attention_backward(g, q, k, v, out, lse, cu, cu, 0.25, causal, configs=configs)

    want = backward(0, grad, q.contiguous(), k.contiguous(), v.contiguous())
    strided_grad = torch.cat([grad, grad[:, :1]], 1)[:, :heads]  # rows of 5 heads: copied for the delta kernel
    for tma in (0, 1):
        for query, g in ((q, grad), (odd_q, grad), (q, strided_grad)):
            for got, expected in zip(backward(tma, g, query, k, v), want, strict=True):
                assert torch.equal(got, expected), (tma, query is odd_q, g is strided_grad)


CASES.parametrize(attention_kernel_backward_tma_equals_pointer_loads, causal=[True, False])


# (query/key head dim D, value head dim W, query heads, key/value heads): values narrower than keys, as MLA's
# absorbed form (D = 576 = 512 + 64 split in two dots, W = 512, one key head), and a wide head whose tail is padded
ATTENTION_HEADS = [(40, 24, 4, 2), (576, 512, 4, 1), (300, 200, 2, 1)]


def _attention_inputs(head, dtype):
    head_dim, value_dim, heads, kv_heads = head
    lens_q, lens_k = [3, 1, 40, 0], [5, 70, 40, 2]
    q = _randn(sum(lens_q), heads, head_dim, dtype=dtype)
    k = _randn(sum(lens_k), kv_heads, head_dim, dtype=dtype, seed=1)
    # one key head: the values are its first W features (the latent cache's kv_c), else values of their own
    v = k[..., :value_dim] if kv_heads == 1 else _randn(sum(lens_k), kv_heads, value_dim, dtype=dtype, seed=2)
    return q, k, v, lens_q, lens_k


def attention_kernel_value_dim_and_split_head(head, dtype):
    """A value dim of its own (W != D) and a wide head split in two dots (attention.split_head): the forward
    against the reference, paged keys (a latent cache whose values are a view of its keys) bitwise equal to
    packed ones, decode tiles to rounding (numpy's BLAS), the backward against the reference and deterministic."""
    from mok.kernels import attention as attention_kernels
    from mok.reference import attention as attention_reference

    q, k, v, lens_q, lens_k = _attention_inputs(head, dtype)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    out, lse = attention_kernels.attention_forward(q, k, v, cu_q, cu_k, 0.1, True)
    out_ref, lse_ref = attention_reference.attention_forward(q, k, v, cu_q, cu_k, 0.1, True)
    assert out.shape == out_ref.shape == (sum(lens_q), head[2], head[1])
    torch.testing.assert_close(out.double(), out_ref.double(), **TOL[dtype])
    torch.testing.assert_close(lse, lse_ref, atol=1e-4, rtol=1e-4)

    if head[3] == 1:
        latent, _, table_BP = to_pages(k, k, lens_k, 16)
        key_cache, value_cache = latent, latent[..., : head[1]]
    else:
        key_cache, value_cache, table_BP = to_pages(k, v, lens_k, 16)
    seq_lens = torch.tensor(lens_k, dtype=torch.int32)
    paged, paged_lse = attention_kernels.paged_attention_forward(q, key_cache, value_cache, cu_q, seq_lens, table_BP,
                                                                 0.1)
    assert torch.equal(paged, out) and torch.equal(paged_lse, lse)
    decode, _ = attention_kernels.paged_attention_forward(q, key_cache, value_cache, cu_q, seq_lens, table_BP, 0.1,
                                                          decode=True)
    torch.testing.assert_close(decode.double(), out.double(), **TOL[dtype])

    grad = _randn(*out.shape, dtype=dtype, seed=3)
    v = v.contiguous()
    got = attention_kernels.attention_backward(grad, q, k, v, out, lse, cu_q, cu_k, 0.1, True)
    want = attention_reference.attention_backward(grad, q, k, v, out, lse, cu_q, cu_k, 0.1, True)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g.double(), w.double(), atol=5e-3 if dtype == torch.float16 else 1e-5, rtol=1e-2)
    again = attention_kernels.attention_backward(grad, q, k, v, out, lse, cu_q, cu_k, 0.1, True)
    assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True))


CASES.parametrize(attention_kernel_value_dim_and_split_head, head=ATTENTION_HEADS, dtype=DTYPES)


def attention_kernel_backward_dq_packs_heads(head, pack):
    """dQ tiles of BLOCK_M // PACK queries times PACK heads of one group (one key tile read for PACK heads, as
    MLA's 128 heads on one latent key head want) give the reference's gradients, deterministically; a PACK that
    does not divide the group is refused."""
    from mok.kernels import attention as attention_kernels
    from mok.reference import attention as attention_reference

    dtype = torch.float16
    q, k, v, lens_q, lens_k = _attention_inputs(head, dtype)
    v = v.contiguous()
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    out, lse = attention_kernels.attention_forward(q, k, v, cu_q, cu_k, 0.1, True)
    grad = _randn(*out.shape, dtype=dtype, seed=3)
    wide = "_wide" if head[0] > attention_kernels.WIDE_HEAD else ""
    configs = {"backward_dq" + wide: dict(BLOCK_M=16, BLOCK_N=16, PACK=pack, num_warps=4, num_stages=1, TMA=0)}

    def dq():
        return attention_kernels.attention_backward(grad, q, k, v, out, lse, cu_q, cu_k, 0.1, True,
                                                    configs=configs)[0]

    want = attention_reference.attention_backward(grad, q, k, v, out, lse, cu_q, cu_k, 0.1, True)[0]
    got = dq()
    torch.testing.assert_close(got.double(), want.double(), atol=5e-3, rtol=1e-2)
    assert torch.equal(got, dq())
    configs["backward_dq" + wide]["PACK"] = 2 * head[2] // head[3]
    try:
        dq()
    except ValueError as error:
        assert "PACK" in str(error)
    else:
        raise AssertionError("a PACK wider than the group was launched")


CASES.parametrize(attention_kernel_backward_dq_packs_heads, head=[(40, 24, 4, 2), (576, 512, 4, 1)], pack=[1, 2])


@CASES.case
def attention_split_head_rule():
    """Heads up to 256 wide, and powers of two, stay one padded block (their kernels and bits are unchanged);
    a wider one splits at its largest power of two."""
    from mok.kernels.attention import split_head

    assert [split_head(d) for d in (16, 40, 128, 192, 256, 512)] == [(16, 0), (64, 0), (128, 0), (256, 0), (256, 0),
                                                                      (512, 0)]
    assert split_head(576) == (512, 64) and split_head(300) == (256, 64) and split_head(260) == (256, 16)


@CASES.case
def attention_kernel_reads_interleaved_caches_in_place():
    """vLLM's GPU cache interleaves each slot's key and value ([P, G, Z, 2 * D] with keys then values per
    row) and may put heads before slots (HND): key/value views whose pages cannot be flattened into rows.
    Written through write_kv_cache and read through those strides, they give the packed keys' bits."""
    from mok.kernels import attention as attention_kernels

    lens_q, lens_k, page_size, head_dim = [2, 1, 4], [2, 37, 20], 16, 16
    q = _randn(sum(lens_q), 4, head_dim, dtype=torch.float16)
    k = _randn(sum(lens_k), 2, head_dim, dtype=torch.float16, seed=1)
    v = _randn(sum(lens_k), 2, head_dim, dtype=torch.float16, seed=2)
    packed, packed_lse = attention_kernels.attention_forward(q, k, v, _cu(lens_q), _cu(lens_k), 0.25, True)
    for heads_first in (False, True):
        num_pages = 8
        shape = (num_pages, 2, page_size, 2 * head_dim) if heads_first else (num_pages, page_size, 2, 2 * head_dim)
        kv_cache = torch.full(shape, float("nan"), dtype=torch.float16)
        kv_ZGx = kv_cache.transpose(1, 2) if heads_first else kv_cache  # [P, Z, G, 2 * D]
        key_cache, value_cache = kv_ZGx[..., :head_dim], kv_ZGx[..., head_dim:]
        pages = torch.randperm(num_pages, generator=torch.Generator().manual_seed(3)).to(torch.int32)
        table_BP = torch.zeros(len(lens_k), 3, dtype=torch.int32)
        slots, used = [], 0
        for b, n in enumerate(lens_k):
            count = -(-n // page_size)
            table_BP[b, :count] = pages[used : used + count]
            slots += [int(table_BP[b, i // page_size]) * page_size + i % page_size for i in range(n)]
            used += count
        attention_kernels.write_kv_cache(k, v, key_cache, value_cache, torch.tensor(slots))
        paged, paged_lse = attention_kernels.paged_attention_forward(
            q, key_cache, value_cache, _cu(lens_q), torch.tensor(lens_k, dtype=torch.int32), table_BP, 0.25)
        assert torch.equal(paged, packed) and torch.equal(paged_lse, packed_lse), heads_first


@CASES.case
def write_kv_cache_kernel_matches_reference():
    from mok.kernels import attention as attention_kernels
    from mok.reference import attention as attention_reference

    k, v = _randn(6, 2, 16, dtype=torch.float16), _randn(6, 2, 16, dtype=torch.float16, seed=1)
    slots = torch.tensor([5, 17, -1, 0, 31, -1])
    caches = [torch.zeros(2, 16, 2, 16, dtype=torch.float16) for _ in range(4)]
    attention_kernels.write_kv_cache(k, v, caches[0], caches[1], slots)
    attention_reference.write_kv_cache(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert torch.equal(caches[0][1, 1], k[1]) and torch.equal(caches[1][1, 15], v[4])
    assert int((caches[0] != 0).any(-1).any(-1).sum()) == 4  # the two padding tokens wrote nothing


test_kernel_logic_under_interpreter = interpreter_test(CASES, __file__)


if __name__ == "__main__":
    sys.exit(run_cases(CASES))
