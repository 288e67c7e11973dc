"""Torch expressions of the CUDA backwards of mok.rms_norm and mok.logprobs, and the checks the Triton backwards
(mok/kernels/rms_norm.py, mok/kernels/logprobs.py) are held to, shared by the interpreter cases
(test_dense_kernels.py, fp16/fp32) and the GPU tests (test_fused_backward_gpu.py, bf16 too).
logprobs: the kernel gives logprobs_backward's bits exactly (tests/helpers/bits.py's `same_bits`, NaN payloads
included). rms_norm: the kernel sums in its own fixed order, so rms_norm_backward is its fp32 accuracy
reference; the bits it promises are its own (check_rms_norm_backward).
"""
from __future__ import annotations

import torch


def rms_norm_backward(grad_TF, x_TF, weight_F, eps, grad_residual_TF=None, residual_dtype=None):
    """-> (d x in x's dtype, d x in residual_dtype or None, d weight in weight's dtype)."""
    x32_TF = x_TF.float()
    rstd_T1 = 1.0 / torch.sqrt((x32_TF * x32_TF).sum(-1, keepdim=True) / x_TF.shape[-1] + eps)
    grad_w_TF = grad_TF.float() * weight_F.float()
    dot_T1 = (grad_w_TF * x32_TF).sum(-1, keepdim=True)
    grad_x_TF = rstd_T1 * grad_w_TF - x32_TF * (rstd_T1 * rstd_T1 * rstd_T1) * (dot_T1 / x_TF.shape[-1])
    grad_weight_F = (grad_TF.float() * (x32_TF * rstd_T1)).sum(0)
    if grad_residual_TF is not None:
        grad_x_TF = grad_x_TF + grad_residual_TF.float()
    grad_x2_TF = None if residual_dtype is None else grad_x_TF.to(residual_dtype)
    return grad_x_TF.to(x_TF.dtype), grad_x2_TF, grad_weight_F.to(weight_F.dtype)


def logprobs_backward(log_softmax_TV, grad_T, token_ids_T, dtype):
    """d logits of logprobs from the fp32 log_softmax [T, V], grad [T] (fp32) and ids [T] in [0, V): torch's exp
    on CUDA tensors; on CPU tensors (the interpreter's kernel) numpy's, which the interpreter's tl.exp is."""
    grad_T1 = grad_T[:, None]
    if log_softmax_TV.is_cuda:
        grad_TV = log_softmax_TV.clone().exp_()
    else:
        import numpy

        grad_TV = torch.from_numpy(numpy.exp(log_softmax_TV.numpy()))
    grad_TV = grad_TV.mul_(grad_T1).neg_()
    picked_T1 = grad_TV.gather(1, token_ids_T[:, None])
    grad_TV.scatter_(1, token_ids_T[:, None], picked_T1 + grad_T1)
    return grad_TV.to(dtype)


def rms_norm_backward_inputs(randn, rows: int, features: int, dtype, residual: str, other_dtype):
    """(grad, weight, grad_residual, residual_dtype) of an rms_norm backward case: zero, -0.0, NaN, inf and
    subnormal gradients and one negative weight. randn(*shape, seed=) gives fp32 values on the test's device;
    residual: "none", "same" (a residual gradient in dtype) or "other" (in other_dtype, which d residual is
    rounded to)."""
    grad = randn(rows, features, seed=1)
    grad[0], grad[1, :4] = 0.0, torch.tensor([-0.0, float("nan"), float("inf"), 1e-40])
    weight = (1 + 0.1 * randn(features, seed=2)).to(dtype)
    weight[3] = -weight[3]
    grad_residual = None if residual == "none" else randn(rows, features, seed=3).to(
        dtype if residual == "same" else other_dtype)
    return grad.to(dtype), weight, grad_residual, other_dtype if residual == "other" else None


def check_rms_norm_backward(kernel_backward, grad, x, weight, grad_residual, residual_dtype, tol: dict) -> None:
    """kernel_backward (a kernels module's rms_norm_backward) against rms_norm_backward within tol[the output's
    dtype] (NaNs where it has them), and its own promises: each row's d x is that row's alone (the first and
    last rows computed alone give the same bits), any layout of x gives the same bits as a contiguous x,
    d residual is the same fp32 value as d x rounded to its dtype (when one of them is fp32, the other equals
    it rounded), and no d residual rows without residual_dtype."""
    from tests.helpers.bits import same_bits

    got = kernel_backward(grad, x, weight, 1e-6, grad_residual, residual_dtype)
    want = rms_norm_backward(grad, x, weight, 1e-6, grad_residual, residual_dtype)
    for g, w in ((got[0], want[0]), (got[2], want[2])) + (((got[1], want[1]),) if residual_dtype else ()):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g.double(), w.double(), equal_nan=True, **tol[g.dtype])
    if residual_dtype and torch.float32 in (got[0].dtype, got[1].dtype):  # fp32 holds the value itself
        wide, narrow = sorted(got[:2], key=lambda t: torch.finfo(t.dtype).eps)
        assert same_bits(wide.to(narrow.dtype), narrow)
    else:
        assert got[1].shape == (0, x.shape[1])
    contiguous = kernel_backward(grad, x.contiguous(), weight, 1e-6, grad_residual, residual_dtype)
    assert all(same_bits(a, b) for a, b in zip(got, contiguous))
    for rows in (slice(0, 1), slice(x.shape[0] - 1, x.shape[0])):
        alone = kernel_backward(grad[rows], x[rows], weight, 1e-6,
                                None if grad_residual is None else grad_residual[rows], residual_dtype)
        assert same_bits(alone[0], got[0][rows]) and (not residual_dtype or same_bits(alone[1], got[1][rows]))


def assert_logprobs_backward_bits(logits_TV: torch.Tensor, grad_T: torch.Tensor, ids_T: torch.Tensor) -> torch.Tensor:
    """mok.logprobs' CUDA backward kernel (mok/kernels/logprobs.py, from the logits) gives logprobs_backward's bits
    on the log_softmax kernel's output for these logits, gradients and ids (out-of-range ids neutralised as the op
    does), and each row's bits are that row's alone. -> the kernel's d logits."""
    from mok.kernels import logprobs as kernels
    from mok.ops import logprobs as ops
    from tests.helpers.bits import same_bits

    ids_T, grad_T = ops._neutralize_ids(ids_T, grad_T, logits_TV.shape[1])
    want_TV = logprobs_backward(kernels.log_softmax(logits_TV), grad_T, ids_T, logits_TV.dtype)
    got_TV = kernels.logprobs_backward(logits_TV, grad_T, ids_T)
    assert same_bits(got_TV, want_TV)
    last = slice(logits_TV.shape[0] - 1, None)
    assert same_bits(kernels.logprobs_backward(logits_TV[last], grad_T[last], ids_T[last]), got_TV[last])
    return got_TV
