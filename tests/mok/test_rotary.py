"""mok.rotary on the CPU reference path."""
import pytest
import torch

import mok
from mok.errors import UnsupportedError

DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 1.6e-2, 1.6e-2)]


def _reference(x, positions, theta, rotary_dim, neox):
    inv = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angle = positions.double()[:, None, None] * inv
    cos, sin = angle.cos(), angle.sin()
    x = x.double()
    if neox:
        x1, x2 = x[..., : rotary_dim // 2], x[..., rotary_dim // 2 : rotary_dim]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rotary_dim:]], -1)
    x1, x2 = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
    rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)
    return torch.cat([rotated, x[..., rotary_dim:]], -1)


def _inputs(t, h, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, h, d, generator=g).to(dtype), torch.randint(0, 4000, (t,), generator=g)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("t,h,d,rotary_dim", [(5, 3, 16, None), (7, 2, 24, 8), (1, 4, 64, 32)])
@pytest.mark.parametrize("neox", [True, False])
def test_matches_torch(t, h, d, rotary_dim, neox, dtype, atol, rtol):
    x, pos = _inputs(t, h, d, dtype)
    out = mok.rotary(x, pos, 10000.0, rotary_dim, neox)
    assert out.dtype == dtype and out.shape == x.shape
    expected = _reference(x, pos, 10000.0, rotary_dim or d, neox)
    # The fp32 angle (position * fp32 inv_freq) is the contract; at positions ~4000 its rounding
    # moves cos/sin by up to ~2e-4 against the fp64 angle.
    torch.testing.assert_close(out.double(), expected.to(dtype).double(), atol=max(atol, 1e-3), rtol=rtol)
    if rotary_dim:
        assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])


def test_batch_invariant_bitwise():
    x, pos = _inputs(33, 4, 32, torch.bfloat16)
    full = mok.rotary(x, pos, 1e6)
    for i in (0, 17, 32):
        assert torch.equal(mok.rotary(x[i : i + 1], pos[i : i + 1], 1e6)[0], full[i])
    perm = torch.randperm(33, generator=torch.Generator().manual_seed(2))
    assert torch.equal(mok.rotary(x[perm], pos[perm], 1e6), full[perm])
    # one head alone equals that head inside all heads (q heads vs k heads)
    assert torch.equal(mok.rotary(x[:, 1:2], pos, 1e6), full[:, 1:2])


@pytest.mark.parametrize("neox", [True, False])
def test_gradient_is_inverse_rotation(neox):
    x, pos = _inputs(6, 2, 16, torch.float32)
    grad = torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(5))
    leaf = x.clone().requires_grad_()
    (mok.rotary(leaf, pos, 500.0, 12, neox) * grad).sum().backward()
    ref = x.double().requires_grad_()
    (_reference(ref, pos, 500.0, 12, neox) * grad.double()).sum().backward()
    torch.testing.assert_close(leaf.grad.double(), ref.grad, atol=1e-3, rtol=1e-4)


def test_bad_rotary_dim_raises():
    with pytest.raises(UnsupportedError, match="rotary_dim"):
        mok.rotary(torch.randn(2, 1, 8), torch.arange(2), 1e4, rotary_dim=7)
    with pytest.raises(UnsupportedError, match="integer"):
        mok.rotary(torch.randn(2, 1, 8), torch.arange(2.0), 1e4)


def test_yarn_inv_freq_matches_transformers_and_rotation_is_its_own_op():
    """YaRN (DeepSeek-V3's rope_type 'yarn'): mok's fp64-then-fp32 inv_freq is within an fp32 ulp of transformers'
    fp32 computation; the rotation scales cos/sin by attention_factor; the backward is the rotation by -angle."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    import mok
    from mok.ops.rotary import YarnScaling
    from mok.reference.rotary import inv_freq

    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=64,
                beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707)
    config = transformers.DeepseekV3Config(hidden_size=64, num_attention_heads=2, qk_rope_head_dim=16,
                                           qk_nope_head_dim=8, v_head_dim=8, rope_parameters=rope)
    theirs, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    yarn = YarnScaling(40.0, 64, 32.0, 1.0, attention_factor)
    ours = inv_freq(10000.0, 16, yarn)
    torch.testing.assert_close(ours, theirs, rtol=2e-7, atol=0)
    assert not torch.equal(ours, inv_freq(10000.0, 16))  # the scaling moved some frequencies
    x = torch.randn(7, 3, 24, generator=torch.Generator().manual_seed(0), requires_grad=True)
    positions = torch.arange(100, 107)
    out = mok.rotary(x, positions, 10000.0, 16, False, yarn=YarnScaling(40.0, 64, 32.0, 1.0, 1.25))
    angle = positions[:, None].double() * ours.double()[None, :]
    x1, x2 = x.detach().double()[..., 0:16:2], x.detach().double()[..., 1:16:2]
    cos, sin = 1.25 * angle.cos()[:, None], 1.25 * angle.sin()[:, None]
    torch.testing.assert_close(out[..., 0:16:2].double(), x1 * cos - x2 * sin, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[..., 16:], x[..., 16:])
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(grad)
    from mok.reference.rotary import rotary as reference_rotary

    scaled = YarnScaling(40.0, 64, 32.0, 1.0, 1.25)
    assert torch.equal(x.grad, reference_rotary(grad, positions, 10000.0, 16, False, True, scaled))
    with pytest.raises(mok.UnsupportedError, match="yarn"):
        mok.rotary(x, positions, 10000.0, 16, yarn=(40.0, 64, 32.0, 1.0, 1.0))
