"""mok.rms_norm on the CPU reference path (plain and fused with the residual add)."""

import pytest
import torch

import mok
from mok.errors import UnsupportedError

DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 1.6e-2, 1.6e-2), (torch.float16, 2e-3, 2e-3)]
SHAPES = [(5, 123), (1, 64), (19, 7)]


def _inputs(t, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        (torch.randn(t, d, generator=g) * 3).to(dtype),
        (1 + 0.5 * torch.randn(d, generator=g)).to(dtype),
        torch.randn(t, d, generator=g).to(dtype),
    )


def _reference(x, w, eps):
    x = x.double()
    return x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("t,d", SHAPES)
def test_matches_torch(t, d, dtype, atol, rtol):
    x, w, r = _inputs(t, d, dtype)
    y = mok.rms_norm(x, w, 1e-6)
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), _reference(x, w, 1e-6).to(dtype).double(), atol=atol, rtol=rtol)
    y2, new_r = mok.rms_norm(x, w, 1e-6, r)
    expected_r = (x.double() + r.double()).to(dtype)
    assert torch.equal(new_r, expected_r)
    torch.testing.assert_close(y2.double(), _reference(new_r, w, 1e-6).to(dtype).double(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_invariant_bitwise(dtype):
    x, w, r = _inputs(29, 96, dtype)
    full = mok.rms_norm(x, w, 1e-5)
    full_y, full_r = mok.rms_norm(x, w, 1e-5, r)
    for i in (0, 13, 28):
        assert torch.equal(mok.rms_norm(x[i : i + 1], w, 1e-5)[0], full[i])
        y, nr = mok.rms_norm(x[i : i + 1], w, 1e-5, r[i : i + 1])
        assert torch.equal(y[0], full_y[i]) and torch.equal(nr[0], full_r[i])
    perm = torch.randperm(29, generator=torch.Generator().manual_seed(3))
    assert torch.equal(mok.rms_norm(x[perm], w, 1e-5), full[perm])
    assert torch.equal(mok.rms_norm(x.reshape(29, 2, 48)[:, :, :].reshape(29, 96)[:7], w, 1e-5), full[:7])


def test_head_dim_norm_leading_dims():
    x, _, _ = _inputs(6, 32, torch.float32)
    w = torch.rand(8) + 0.5
    y = mok.rms_norm(x.reshape(6, 4, 8), w, 1e-6)
    assert torch.equal(y.reshape(24, 8), mok.rms_norm(x.reshape(24, 8), w, 1e-6))


@pytest.mark.parametrize("t,d", SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_gradients_match_autograd(t, d, with_residual):
    x, w, r = _inputs(t, d, torch.float32)
    g = torch.Generator().manual_seed(4)
    grad_y, grad_r = torch.randn(t, d, generator=g), torch.randn(t, d, generator=g)
    ours = [a.clone().requires_grad_() for a in (x, w, r)]
    ref = [a.double().requires_grad_() for a in (x, w, r)]
    if with_residual:
        y, nr = mok.rms_norm(ours[0], ours[1], 1e-6, ours[2])
        (y * grad_y + nr * grad_r).sum().backward()
        h = ref[0] + ref[2]
        (_reference(h, ref[1], 1e-6) * grad_y.double() + h * grad_r.double()).sum().backward()
    else:
        (mok.rms_norm(ours[0], ours[1], 1e-6) * grad_y).sum().backward()
        (_reference(ref[0], ref[1], 1e-6) * grad_y.double()).sum().backward()
    for a, b in zip(ours, ref):
        if b.grad is None:
            assert a.grad is None
            continue
        torch.testing.assert_close(a.grad.double(), b.grad, atol=1e-4, rtol=1e-4)


def test_backward_deterministic():
    x, w, r = _inputs(11, 48, torch.bfloat16)

    def grads():
        leaves = [a.clone().requires_grad_() for a in (x, w, r)]
        y, nr = mok.rms_norm(*leaves[:2], 1e-6, leaves[2])
        (y.float().square().sum() + nr.float().sum()).backward()
        return [a.grad for a in leaves]

    for a, b in zip(grads(), grads()):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)


def test_bad_weight_raises():
    with pytest.raises(UnsupportedError, match="weight"):
        mok.rms_norm(torch.randn(3, 4), torch.randn(5), 1e-6)
