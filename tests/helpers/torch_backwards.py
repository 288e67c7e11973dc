"""The torch expressions the CUDA backwards of mok.rms_norm and mok.logprobs ran before their element-wise
steps moved into Triton kernels (mok/kernels/rms_norm.py, mok/kernels/logprobs.py). The kernels promise
these bits exactly (NaN payloads included): the interpreter cases (test_dense_kernels.py, fp16/fp32) and
the GPU tests (test_fused_backward_gpu.py, bf16 too) compare against them with `same_bits`.
"""
from __future__ import annotations

import torch


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and every bit (so NaN payloads and the sign of zero count)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


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
    """d logits of logprobs from the fp32 log_softmax [T, V], grad [T] (fp32) and ids [T] in [0, V)."""
    grad_T1 = grad_T[:, None]
    grad_TV = log_softmax_TV.clone().exp_().mul_(grad_T1).neg_()
    picked_T1 = grad_TV.gather(1, token_ids_T[:, None])
    grad_TV.scatter_(1, token_ids_T[:, None], picked_T1 + grad_T1)
    return grad_TV.to(dtype)
