"""mok.linear on the CPU reference path: accuracy, batch invariance, gradients, determinism."""
import pytest
import torch

import mok
from mok.errors import UnsupportedError

DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 2e-2, 2e-2), (torch.float16, 2e-3, 2e-3)]
SHAPES = [(5, 123, 7), (1, 64, 33), (17, 31, 96)]  # (T, K, N)


def _inputs(t, k, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    return x, w, b


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("t,k,n", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_fp32_torch(t, k, n, dtype, atol, rtol, with_bias):
    x, w, b = _inputs(t, k, n, dtype)
    out = mok.linear(x, w, b if with_bias else None)
    expected = x.double() @ w.double().t() + (b.double() if with_bias else 0)
    assert out.dtype == dtype and out.shape == (t, n)
    torch.testing.assert_close(out.double(), expected.to(dtype).double(), atol=atol, rtol=rtol)


def test_leading_dims():
    x, w, b = _inputs(6, 20, 9, torch.float32)
    out = mok.linear(x.reshape(2, 3, 20), w, b)
    assert out.shape == (2, 3, 9)
    assert torch.equal(out.reshape(6, 9), mok.linear(x, w, b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_invariant_bitwise(dtype):
    x, w, b = _inputs(37, 96, 50, dtype)
    full = mok.linear(x, w, b)
    for i in (0, 5, 36):
        assert torch.equal(mok.linear(x[i : i + 1], w, b)[0], full[i])
    for size in (2, 9, 23):
        assert torch.equal(mok.linear(x[:size], w, b), full[:size])
    perm = torch.randperm(37, generator=torch.Generator().manual_seed(1))
    assert torch.equal(mok.linear(x[perm], w, b), full[perm])


@pytest.mark.parametrize("t,k,n", SHAPES)
def test_gradients_match_autograd(t, k, n):
    x, w, b = _inputs(t, k, n, torch.float32)
    grad = torch.randn(t, n, generator=torch.Generator().manual_seed(2))
    ours = [a.clone().requires_grad_() for a in (x, w, b)]
    (mok.linear(*ours) * grad).sum().backward()
    ref = [a.double().requires_grad_() for a in (x, w, b)]
    (torch.nn.functional.linear(*ref) * grad.double()).sum().backward()
    for a, r in zip(ours, ref):
        assert a.grad.dtype == torch.float32
        torch.testing.assert_close(a.grad.double(), r.grad, atol=1e-4, rtol=1e-4)


def test_backward_deterministic_and_bf16_dtypes():
    x, w, b = _inputs(9, 40, 12, torch.bfloat16)

    def grads():
        leaves = [a.clone().requires_grad_() for a in (x, w, b)]
        mok.linear(*leaves).float().square().sum().backward()
        return [a.grad for a in leaves]

    first, second = grads(), grads()
    for a, c in zip(first, second):
        assert a.dtype == torch.bfloat16 and torch.equal(a, c)


def test_bad_shapes_raise():
    with pytest.raises(UnsupportedError, match="does not match"):
        mok.linear(torch.randn(3, 4), torch.randn(5, 6))
    with pytest.raises(UnsupportedError, match="dtypes"):
        mok.linear(torch.ones(3, 4, dtype=torch.int32), torch.randn(5, 4))


def test_emits_when_named():
    seen = []
    x, w, _ = _inputs(3, 8, 4, torch.float32)
    with mok.hooks.observe(lambda name, t, kind: seen.append((name, kind, t.shape))):
        mok.linear(x, w, name="layers.0.o_proj")
        mok.linear(x, w)
    assert seen == [("layers.0.o_proj", "input", (3, 8)), ("layers.0.o_proj", "output", (3, 4))]
