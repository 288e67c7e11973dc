"""The element-wise backward kernels of mok.rms_norm and mok.logprobs on a CUDA GPU give every bit of the torch
expressions they replaced (tests/helpers/torch_backwards.py): no FMA contraction, the same sums, the same
round-to-nearest-even conversions, canonical NaNs; bf16 included (the interpreter cases cover fp16/fp32)."""

import pytest
import torch

from tests.helpers import torch_backwards

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


def _randn(*shape, seed=0, scale=1.0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEVICE) * scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,features", [(4096, 2048), (32768, 128), (7, 37)])
@pytest.mark.parametrize("residual", ["none", "same", "other"])
def test_rms_norm_backward_kernels_give_the_torch_bits(dtype, rows, features, residual):
    from mok.kernels import rms_norm as kernels

    x = _randn(rows, features, scale=3).to(dtype)
    other = torch.float32 if dtype != torch.float32 else torch.bfloat16
    grad, weight, grad_residual, residual_dtype = torch_backwards.rms_norm_backward_inputs(
        _randn, rows, features, dtype, residual, other)
    # contiguous, transposed, strided rows
    for layout in (x, x.t().contiguous().t(), torch.cat([x, x], 1)[:, :features]):
        torch_backwards.assert_rms_norm_backward_bits(kernels.rms_norm_backward, grad, layout, weight, grad_residual,
                                                      residual_dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,vocab", [(64, 151936), (300, 5003)])
def test_logprobs_backward_kernel_gives_the_torch_bits(dtype, rows, vocab):
    """Logits spread wide enough that some probabilities are subnormal or zero; zero, -0.0 and NaN (an
    out-of-range id) gradients."""
    logits = _randn(rows, vocab, scale=30).to(dtype)
    grad = _randn(rows, seed=1)
    grad[2], grad[3] = 0.0, -0.0
    ids = torch.randint(0, vocab, (rows,), device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(5))
    ids[4], ids[5] = vocab, -2
    torch_backwards.assert_logprobs_backward_bits(logits, grad, ids)
