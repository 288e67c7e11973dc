"""mok.attention on the CPU reference path: accuracy, prefill == chunked prefill == decode bitwise,
batch invariance across mixed lengths, gradients."""

import pytest
import torch

from mok.errors import UnsupportedError
from mok.ops.attention import attention, paged_attention, write_kv_cache
from tests.helpers.paged_cache import slot_mapping, to_pages

DTYPES = [(torch.float32, 2e-6, 1e-5), (torch.bfloat16, 2e-2, 2e-2)]


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _qkv(n_q, n_k, hq, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n_q, hq, d, generator=g).to(dtype),
        torch.randn(n_k, hkv, d, generator=g).to(dtype),
        torch.randn(n_k, hkv, d, generator=g).to(dtype),
    )


def _reference(q, k, v, lens_q, lens_k, scale, causal):
    """Plain fp64 softmax attention, one sequence at a time."""
    group = q.shape[1] // k.shape[1]
    outs, cq, ck = [], _cu(lens_q), _cu(lens_k)
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        qb = q[cq[b] : cq[b + 1]].double().transpose(0, 1)
        kb = k[ck[b] : ck[b + 1]].double().transpose(0, 1).repeat_interleave(group, 0)
        vb = v[ck[b] : ck[b + 1]].double().transpose(0, 1).repeat_interleave(group, 0)
        s = qb @ kb.transpose(1, 2) * scale
        if causal:
            visible = torch.arange(lk)[None, :] <= (torch.arange(lq) + lk - lq)[:, None]
            s = s.masked_fill(~visible, -torch.inf)
        outs.append((s.softmax(-1) @ vb).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 16), (3, 3, 24), (8, 1, 8)])
@pytest.mark.parametrize("causal", [True, False])
def test_matches_torch(hq, hkv, d, causal, dtype, atol, rtol):
    lens_q, lens_k = [5, 1, 3, 0, 70], [5, 9, 3, 4, 70]
    q, k, v = _qkv(sum(lens_q), sum(lens_k), hq, hkv, d, dtype)
    out = attention(q, k, v, _cu(lens_q), _cu(lens_k), d**-0.5, causal=causal)
    assert out.dtype == dtype and out.shape == q.shape
    expected = _reference(q, k, v, lens_q, lens_k, d**-0.5, causal)
    torch.testing.assert_close(out.double(), expected.to(dtype).double(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_chunked_decode_bitwise(dtype):
    """Every query gets identical bits whether its sequence is prefilled whole, in chunks, or decoded
    token by token, alone or next to other sequences, with unused keys after the last sequence."""
    hq, hkv, d = 4, 2, 16
    lengths = [139, 1, 64, 65]
    q, k, v = _qkv(sum(lengths), sum(lengths) + 5, hq, hkv, d, dtype)
    cu = _cu(lengths)
    prefill = attention(q, k, v, cu, cu, 0.25)
    for b, length in enumerate(lengths):
        start = int(cu[b])
        qs, ks, vs = q[start : start + length], k[start : start + length], v[start : start + length]
        alone = attention(qs, ks, vs, _cu([length]), _cu([length]), 0.25)
        assert torch.equal(alone, prefill[start : start + length])
        # chunked prefill: chunks of 50 queries against all keys so far
        chunks = [
            attention(
                qs[c : c + 50], ks[: c + 50], vs[: c + 50], _cu([min(50, length - c)]), _cu([min(c + 50, length)]), 0.25
            )
            for c in range(0, length, 50)
        ]
        assert torch.equal(torch.cat(chunks), alone)
    # decode: one query per sequence, all sequences in one batch, at several steps
    for step in (0, 1, 63, 64, 138):
        rows = [b for b, length in enumerate(lengths) if length > step]
        q_rows = torch.stack([q[int(cu[b]) + step] for b in rows])
        k_cat = torch.cat([k[int(cu[b]) : int(cu[b]) + step + 1] for b in rows])
        v_cat = torch.cat([v[int(cu[b]) : int(cu[b]) + step + 1] for b in rows])
        out = attention(q_rows, k_cat, v_cat, _cu([1] * len(rows)), _cu([step + 1] * len(rows)), 0.25)
        for i, b in enumerate(rows):
            assert torch.equal(out[i], prefill[int(cu[b]) + step])


def test_batch_order_and_companions_do_not_matter():
    lengths = [7, 33, 2, 70]
    q, k, v = _qkv(sum(lengths), sum(lengths), 2, 1, 8, torch.bfloat16, seed=3)
    cu = _cu(lengths)
    base = attention(q, k, v, cu, cu, 0.3)
    order = [3, 0, 2, 1]

    def pieces(t):
        return [t[int(cu[b]) : int(cu[b + 1])] for b in order]

    out = attention(
        torch.cat(pieces(q)),
        torch.cat(pieces(k)),
        torch.cat(pieces(v)),
        _cu([lengths[b] for b in order]),
        _cu([lengths[b] for b in order]),
        0.3,
    )
    assert torch.equal(out, torch.cat(pieces(base)))


@pytest.mark.parametrize("causal", [True, False])
def test_gradients_match_autograd(causal):
    lens_q, lens_k = [4, 1, 6, 66], [4, 5, 9, 66]
    q, k, v = _qkv(sum(lens_q), sum(lens_k), 4, 2, 8, torch.float32, seed=7)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(8))
    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    (attention(*ours, _cu(lens_q), _cu(lens_k), 0.4, causal=causal) * grad).sum().backward()
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    (_reference(*ref, lens_q, lens_k, 0.4, causal) * grad.double()).sum().backward()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad.double(), b.grad, atol=2e-5, rtol=1e-4)


def test_backward_deterministic_bf16():
    lengths = [9, 3]
    q, k, v = _qkv(12, 12, 2, 2, 8, torch.bfloat16, seed=9)

    def grads():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        attention(*leaves, _cu(lengths), _cu(lengths), 0.35).float().square().sum().backward()
        return [t.grad for t in leaves]

    for a, b in zip(grads(), grads()):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)


def test_bad_inputs_raise():
    q, k, v = _qkv(4, 4, 3, 2, 8, torch.float32)
    with pytest.raises(UnsupportedError, match="multiple"):
        attention(q, k, v, _cu([4]), _cu([4]), 1.0)
    q, k, v = _qkv(4, 3, 2, 2, 8, torch.float32)
    with pytest.raises(UnsupportedError, match="at least as many keys"):
        attention(q, k, v, _cu([4]), _cu([3]), 1.0)
    with pytest.raises(UnsupportedError, match="ends at"):
        attention(q, k, v, _cu([3]), _cu([3]), 1.0)


def _to_pages(k, v, lens_k, page_size):
    """The paged cache of tests/helpers/paged_cache.py, written through mok.write_kv_cache (3 padding slots
    of -1 mixed in) and checked against the helper's direct copy."""
    want_keys, want_values, table_BP = to_pages(k, v, lens_k, page_size)
    key_cache, value_cache = torch.full_like(want_keys, float("nan")), torch.full_like(want_values, float("nan"))
    padded = torch.cat([slot_mapping(table_BP, lens_k, page_size), torch.full((3,), -1)])
    write_kv_cache(torch.cat([k, k[:3] * 0 + 7]), torch.cat([v, v[:3] * 0 + 7]), key_cache, value_cache, padded)
    assert torch.equal(key_cache.nan_to_num(), want_keys.nan_to_num())
    assert torch.equal(value_cache.nan_to_num(), want_values.nan_to_num())
    return key_cache, value_cache, table_BP


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_prefill_chunk_and_decode_equal_the_training_forward(page_size, dtype):
    lens = [1, 17, 64, 65, 130]
    q, k, v = _qkv(sum(lens), sum(lens), 4, 2, 16, dtype, seed=11)
    full = attention(q, k, v, _cu(lens), _cu(lens), 0.3)
    key_cache, value_cache, table_BP = _to_pages(k, v, lens, page_size)
    assert not key_cache.eq(7).any()  # the padding tokens wrote nothing
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    assert torch.equal(paged_attention(q, key_cache, value_cache, _cu(lens), seq_lens, table_BP, 0.3), full)
    for chunk in (1, 5):
        chunk_lens = [min(chunk, n) for n in lens]
        rows = torch.cat([torch.arange(end - c, end) for end, c in zip(_cu(lens)[1:].tolist(), chunk_lens)])
        out = paged_attention(
            q[rows], key_cache, value_cache, _cu(chunk_lens), seq_lens, table_BP, 0.3, decode=chunk == 1
        )
        assert torch.equal(out, full[rows])


def test_paged_bad_inputs_raise():
    q, k, v = _qkv(4, 4, 2, 2, 8, torch.float32)
    key_cache, value_cache, table_BP = _to_pages(k, v, [4], 16)
    seq_lens = torch.tensor([4], dtype=torch.int32)
    with pytest.raises(UnsupportedError, match="int32"):
        paged_attention(q, key_cache, value_cache, _cu([4]), seq_lens.long(), table_BP, 1.0)
    with pytest.raises(UnsupportedError, match=r"\[P, Z, G, D\]"):
        paged_attention(q, key_cache[0], value_cache[0], _cu([4]), seq_lens, table_BP, 1.0)
    with pytest.raises(UnsupportedError, match="head dim"):
        paged_attention(q[..., :4].contiguous(), key_cache, value_cache, _cu([4]), seq_lens, table_BP, 1.0)
    with pytest.raises(UnsupportedError, match="slot_mapping"):
        write_kv_cache(k, v, key_cache, value_cache, torch.zeros(3, dtype=torch.int64))
