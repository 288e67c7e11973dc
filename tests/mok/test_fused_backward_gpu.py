"""The fused backward kernels on a CUDA GPU, bf16 included (the interpreter cases cover fp16/fp32):
mok.rms_norm's (against the torch expression within tolerance, and its own bit promises: a row's d x is that
row's alone, layouts and reruns give the same bits), mok.silu_and_mul's, and mok.logprobs' (every bit of the
torch steps it replaced: no FMA contraction, the same round-to-nearest-even conversions, canonical NaNs)."""

import pytest
import torch

from tests.helpers import torch_backwards

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


def _randn(*shape, seed=0, scale=1.0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEVICE) * scale


TOL = {torch.bfloat16: dict(atol=3e-2, rtol=2e-2), torch.float16: dict(atol=4e-3, rtol=4e-3),
       torch.float32: dict(atol=1e-3, rtol=1e-4)}  # d weight: sums of 32768 rows in another order


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,features", [(4096, 2048), (32768, 128), (7, 37), (3000, 7168)])
@pytest.mark.parametrize("residual", ["none", "same", "other"])
def test_rms_norm_backward_kernel(dtype, rows, features, residual):
    from mok.kernels import rms_norm as kernels
    from tests.helpers.bits import same_bits

    x = _randn(rows, features, scale=3).to(dtype)
    other = torch.float32 if dtype != torch.float32 else torch.bfloat16
    grad, weight, grad_residual, residual_dtype = torch_backwards.rms_norm_backward_inputs(
        _randn, rows, features, dtype, residual, other)
    # contiguous, transposed, strided rows
    for layout in (x, x.t().contiguous().t(), torch.cat([x, x], 1)[:, :features]):
        torch_backwards.check_rms_norm_backward(kernels.rms_norm_backward, grad, layout, weight, grad_residual,
                                                residual_dtype, TOL)
    first = kernels.rms_norm_backward(grad, x, weight, 1e-6, grad_residual, residual_dtype)
    again = kernels.rms_norm_backward(grad, x, weight, 1e-6, grad_residual, residual_dtype)
    assert all(same_bits(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,inter", [(4096, 768), (5, 6144), (33, 37)])
def test_silu_and_mul_backward_kernel(dtype, rows, inter):
    from mok.kernels import silu_and_mul as kernels
    from tests.helpers.bits import same_bits

    x = _randn(rows, 2 * inter, scale=3).to(dtype)
    grad = _randn(rows, inter, seed=1).to(dtype)
    got = kernels.silu_and_mul_backward(grad, x)
    gate, up, grad32 = x[:, :inter].double(), x[:, inter:].double(), grad.double()
    sig = torch.sigmoid(gate)
    want = torch.cat([grad32 * up * sig * (1 + gate * (1 - sig)), grad32 * gate * sig], 1)
    torch.testing.assert_close(got.double(), want, **TOL[dtype])
    assert same_bits(kernels.silu_and_mul_backward(grad, x), got)
    assert same_bits(kernels.silu_and_mul_backward(grad[-1:], x[-1:]), got[-1:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,vocab", [(64, 151936), (300, 5003)])
def test_logprobs_backward_kernel_gives_the_torch_bits(dtype, rows, vocab):
    """Logits spread wide enough that some probabilities are subnormal or zero (and one -inf logit); zero, -0.0 and
    NaN (an out-of-range id) gradients; rows strided (a view of wider rows)."""
    logits = _randn(rows, vocab + 3, scale=30).to(dtype)[:, :vocab]
    logits[1, 7] = float("-inf")
    grad = _randn(rows, seed=1)
    grad[2], grad[3] = 0.0, -0.0
    ids = torch.randint(0, vocab, (rows,), device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(5))
    ids[4], ids[5] = vocab, -2
    torch_backwards.assert_logprobs_backward_bits(logits, grad, ids)
