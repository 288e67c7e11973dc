"""mok.silu_and_mul on the CPU reference path."""
import pytest
import torch

import mok
from mok.errors import UnsupportedError

DTYPES = [(torch.float32, 1e-6, 1e-5), (torch.bfloat16, 1.6e-2, 1.6e-2), (torch.float16, 2e-3, 2e-3)]


def _reference(x):
    x = x.double()
    gate, up = x.chunk(2, -1)
    return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("shape", [(5, 246), (1, 2), (3, 4, 18)])
def test_matches_torch(shape, dtype, atol, rtol):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    out = mok.silu_and_mul(x)
    assert out.dtype == dtype and out.shape == (*shape[:-1], shape[-1] // 2)
    torch.testing.assert_close(out.double(), _reference(x).to(dtype).double(), atol=atol, rtol=rtol)


def test_batch_invariant_bitwise():
    x = torch.randn(41, 130, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16) * 3
    full = mok.silu_and_mul(x)
    for i in (0, 20, 40):
        assert torch.equal(mok.silu_and_mul(x[i : i + 1])[0], full[i])
    perm = torch.randperm(41, generator=torch.Generator().manual_seed(2))
    assert torch.equal(mok.silu_and_mul(x[perm]), full[perm])


def test_gradients_match_autograd_and_are_deterministic():
    x = torch.randn(7, 30, generator=torch.Generator().manual_seed(3)) * 3
    grad = torch.randn(7, 15, generator=torch.Generator().manual_seed(4))
    leaf = x.clone().requires_grad_()
    (mok.silu_and_mul(leaf) * grad).sum().backward()
    ref = x.double().requires_grad_()
    (_reference(ref) * grad.double()).sum().backward()
    torch.testing.assert_close(leaf.grad.double(), ref.grad, atol=1e-5, rtol=1e-5)
    again = x.clone().requires_grad_()
    (mok.silu_and_mul(again) * grad).sum().backward()
    assert torch.equal(again.grad, leaf.grad)


def test_odd_width_raises():
    with pytest.raises(UnsupportedError, match="even"):
        mok.silu_and_mul(torch.randn(2, 5))
