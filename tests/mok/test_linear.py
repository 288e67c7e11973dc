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


HEAD_SHAPES = [(5, 3, 123, 7), (1, 16, 64, 33), (17, 2, 31, 96)]  # (T, Q, F, O)


def _head_inputs(t, q, f, o, dtype, seed=0, strided=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, q, f, generator=g).to(dtype)
    # strided: the weight a view of a bigger one, [Q, F, O] stored (rl/models/mla.py's W_UK)
    w = torch.randn(q, f, o + 3, generator=g)[..., :o].transpose(1, 2) if strided else torch.randn(q, o, f, generator=g)
    return x, (w / f**0.5).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,q,f,o", HEAD_SHAPES)
@pytest.mark.parametrize("strided", [False, True])
def test_head_linear_is_each_heads_linear_bitwise(t, q, f, o, dtype, strided):
    """Forward and both gradients: head q's bits are mok.linear's on that head alone."""
    x, w = _head_inputs(t, q, f, o, dtype, strided=strided)
    grad = torch.randn(t, q, o, generator=torch.Generator().manual_seed(3)).to(dtype)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = mok.head_linear(xs, ws)
    (out.float() * grad.float()).sum().backward()
    assert out.shape == (t, q, o) and out.dtype == dtype
    for h in range(q):
        xh, wh = x[:, h].clone().requires_grad_(), w[h].clone().requires_grad_()
        out_h = mok.linear(xh, wh)
        (out_h.float() * grad[:, h].float()).sum().backward()
        assert torch.equal(out[:, h], out_h)
        assert torch.equal(xs.grad[:, h], xh.grad) and torch.equal(ws.grad[h], wh.grad)


def test_head_linear_batch_invariant_and_leading_dims():
    x, w = _head_inputs(37, 4, 40, 9, torch.bfloat16)
    full = mok.head_linear(x, w)
    for rows in (slice(0, 1), slice(5, 6), slice(0, 23), slice(9, 37)):
        assert torch.equal(mok.head_linear(x[rows], w), full[rows])
    assert torch.equal(mok.head_linear(x[:36].reshape(4, 9, 4, 40), w), full[:36].reshape(4, 9, 4, 9))
    torch.testing.assert_close(full.double(), torch.einsum("tqf,qof->tqo", x.double(), w.double()).to(
        torch.bfloat16).double(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("x_shape,w_shape", [((5, 3, 8), (3, 6, 7)), ((5, 3, 8), (2, 6, 8)), ((8,), (1, 6, 8)),
                                             ((5, 3, 8), (6, 8))])
def test_head_linear_refuses_mismatched_shapes(x_shape, w_shape):
    with pytest.raises(UnsupportedError, match="head_linear"):
        mok.head_linear(torch.randn(x_shape), torch.randn(w_shape))


def test_head_linear_refuses_integer_dtypes():
    with pytest.raises(UnsupportedError, match="head_linear: dtypes"):
        mok.head_linear(torch.ones(2, 3, 4, dtype=torch.int32), torch.ones(3, 5, 4, dtype=torch.int32))
