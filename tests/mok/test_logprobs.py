"""mok.log_softmax / mok.logprobs on the CPU reference path (fp32 results)."""
import pytest
import torch

from mok.errors import UnsupportedError
from mok.ops.logprobs import log_softmax, logprobs

DTYPES = [(torch.float32, 2e-5, 1e-5), (torch.bfloat16, 2e-5, 1e-5)]


def _inputs(t, v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, v, generator=g) * 4).to(dtype), torch.randint(0, v, (t,), generator=g)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("t,v", [(5, 123), (1, 2048), (9, 4099), (3, 1)])
def test_matches_torch(t, v, dtype, atol, rtol):
    x, ids = _inputs(t, v, dtype)
    out = log_softmax(x)
    assert out.dtype == torch.float32 and out.shape == (t, v)
    # bf16 logits are exact in fp32, so the result is compared with the fp64 log_softmax of the same values.
    torch.testing.assert_close(out.double(), torch.log_softmax(x.double(), -1), atol=atol, rtol=rtol)
    picked = logprobs(x, ids)
    assert picked.dtype == torch.float32 and torch.equal(picked, out.gather(1, ids[:, None])[:, 0])


def test_masked_logits():
    x, ids = _inputs(4, 300, torch.float32)
    x[:, 100:] = -torch.inf
    out = log_softmax(x)
    assert torch.isneginf(out[:, 100:]).all()
    torch.testing.assert_close(out[:, :100].double(), torch.log_softmax(x[:, :100].double(), -1), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_invariant_bitwise(dtype):
    x, ids = _inputs(31, 1500, dtype)
    full, full_picked = log_softmax(x), logprobs(x, ids)
    for i in (0, 15, 30):
        assert torch.equal(log_softmax(x[i : i + 1])[0], full[i])
        assert torch.equal(logprobs(x[i : i + 1], ids[i : i + 1])[0], full_picked[i])
    perm = torch.randperm(31, generator=torch.Generator().manual_seed(2))
    assert torch.equal(log_softmax(x[perm]), full[perm])
    assert torch.equal(logprobs(x[perm], ids[perm]), full_picked[perm])


@pytest.mark.parametrize("which", ["log_softmax", "logprobs"])
def test_gradients_match_autograd_and_are_deterministic(which):
    x, ids = _inputs(6, 257, torch.float32)
    g = torch.Generator().manual_seed(5)
    grad = torch.randn(6, 257, generator=g) if which == "log_softmax" else torch.randn(6, generator=g)

    def ours():
        leaf = x.clone().requires_grad_()
        out = log_softmax(leaf) if which == "log_softmax" else logprobs(leaf, ids)
        (out * grad).sum().backward()
        return leaf.grad

    ref = x.double().requires_grad_()
    full = torch.log_softmax(ref, -1)
    out = full if which == "log_softmax" else full.gather(1, ids[:, None])[:, 0]
    (out * grad.double()).sum().backward()
    first = ours()
    torch.testing.assert_close(first.double(), ref.grad, atol=1e-5, rtol=1e-5)
    assert torch.equal(first, ours())


def test_bad_token_ids_raise():
    x, _ = _inputs(2, 10, torch.float32)
    with pytest.raises(UnsupportedError, match="token ids"):
        logprobs(x, torch.tensor([0, 10]))
    with pytest.raises(UnsupportedError, match=r"\[T, V\]"):
        log_softmax(torch.randn(10))
