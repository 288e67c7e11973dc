"""mok.attention / mok.paged_attention with a value head dim W other than the query/key head dim D (the CPU
reference; Multi-head Latent Attention's absorbed form: keys [kv_c, k_pe], values kv_c): accuracy, the bits of
the first W features of the D-wide form, paged == packed, gradients, and the checks."""

import pytest
import torch

from mok.errors import UnsupportedError
from mok.ops.attention import attention, paged_attention, write_kv_cache
from tests.mok.test_attention import _cu, _reference


def _mla_inputs(n_q, n_k, hq, d, dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_q, hq, d, generator=g).to(dtype)
    k = torch.randn(n_k, 1, d, generator=g).to(dtype)
    return q, k, k[..., :dv]  # the values are the keys' first W features, as kv_c in the latent cache


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_value_dim_matches_fp64(dtype, atol):
    lens_q, lens_k = [5, 1, 70], [5, 9, 70]
    q, k, v = _mla_inputs(sum(lens_q), sum(lens_k), 4, 40, 24, dtype)
    out = attention(q, k, v, _cu(lens_q), _cu(lens_k), 0.2)
    assert out.shape == (sum(lens_q), 4, 24) and out.dtype == dtype
    expected = _reference(q, k, v, lens_q, lens_k, 0.2, True)
    torch.testing.assert_close(out.double(), expected.to(dtype).double(), atol=atol, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_value_dim_gives_the_bits_of_the_wide_form(dtype):
    """Each output feature is its own sum over the keys: the W-wide values give exactly the first W features of
    the D-wide computation (so the extension changes no bit of the square form)."""
    lens = [3, 66, 130]
    q, k, v = _mla_inputs(sum(lens), sum(lens), 3, 36, 20, dtype, seed=1)
    narrow = attention(q, k, v.contiguous(), _cu(lens), _cu(lens), 0.15)
    wide = attention(q, k, k, _cu(lens), _cu(lens), 0.15)
    assert torch.equal(narrow, wide[..., :20])


def test_value_dim_paged_equals_packed_and_decode():
    lens, page_size, dv = [1, 17, 40], 16, 12
    q, k, v = _mla_inputs(sum(lens), sum(lens), 2, 20, dv, torch.bfloat16, seed=2)
    full = attention(q, k, v, _cu(lens), _cu(lens), 0.3)
    num_pages = sum(-(-n // page_size) for n in lens)
    latent_PZ1D = torch.zeros(num_pages, page_size, 1, 20, dtype=torch.bfloat16)
    table, slots, page = torch.zeros(len(lens), 3, dtype=torch.int32), [], 0
    for b, n in enumerate(lens):
        for z in range(-(-n // page_size)):
            table[b, z] = page
            page += 1
        slots += [int(table[b, i // page_size]) * page_size + i % page_size for i in range(n)]
    # One latent cache: the value view is its first W features (vLLM's MLA cache layout).
    write_kv_cache(k, v, latent_PZ1D, latent_PZ1D[..., :dv], torch.tensor(slots))
    assert torch.equal(latent_PZ1D.flatten(0, 1)[torch.tensor(slots)], k)  # the values wrote the keys' own bits
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = paged_attention(q, latent_PZ1D, latent_PZ1D[..., :dv], _cu(lens), seq_lens, table, 0.3)
    assert torch.equal(out, full)
    rows = torch.tensor([end - 1 for end in _cu(lens)[1:].tolist()])
    decode = paged_attention(q[rows], latent_PZ1D, latent_PZ1D[..., :dv], _cu([1, 1, 1]), seq_lens, table, 0.3,
                             decode=True)
    assert torch.equal(decode, full[rows])


def test_value_dim_gradients_match_autograd():
    lens_q, lens_k = [4, 1, 66], [4, 5, 66]
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, h, d, generator=g) for n, h, d in ((71, 4, 12), (75, 2, 12), (75, 2, 7)))
    grad = torch.randn(71, 4, 7, generator=g)
    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    (attention(*ours, _cu(lens_q), _cu(lens_k), 0.4) * grad).sum().backward()
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    (_reference(*ref, lens_q, lens_k, 0.4, True) * grad.double()).sum().backward()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad.double(), b.grad, atol=2e-5, rtol=1e-4)


def test_value_dim_checks():
    q, k, v = _mla_inputs(4, 4, 2, 8, 5, torch.float32)
    with pytest.raises(UnsupportedError, match=r"\[S, G, W\]"):
        attention(q, k, v[:, :, :0], _cu([4]), _cu([4]), 1.0)
    with pytest.raises(UnsupportedError, match=r"\[S, G, W\]"):
        attention(q, k, v.expand(4, 2, 5), _cu([4]), _cu([4]), 1.0)
    cache = torch.zeros(1, 16, 1, 8)
    with pytest.raises(UnsupportedError, match="W"):
        write_kv_cache(k, v, cache, cache[..., :4], torch.arange(4))
