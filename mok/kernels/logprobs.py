"""Triton log_softmax / logprobs behind mok.log_softmax and mok.logprobs.

Shapes: docs/shapes.md. One program per row walks the row in chunks of BLOCK_V (a function of V
only): pass 1 keeps an element-wise running max over chunks, pass 2 an element-wise running sum of
exp(x - max), each finished by one tl.sum/tl.max, so a row's order depends on V only and never on T.
log_softmax = (x - max) - log(sum), as in mok/reference/logprobs.py (the order inside differs).
A token id outside [0, V) gives NaN, read nowhere out of bounds (docs/contracts.md, "Log-probabilities").
The backward of logprobs (logprobs_backward) is one kernel from the logits: the row's statistics again, then
- exp(log_softmax) * grad, plus grad at the token, rounded to the logits' dtype; no fp32 [T, V] in between.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from mok.kernels.launch import INTERPRET, cached_launch
from mok.kernels.layout import last_dim_contiguous


@triton.jit
def _row_max_and_log_sum(row_ptr, V, BLOCK_V: tl.constexpr):
    offs = tl.arange(0, BLOCK_V)
    running_max = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    for start in range(0, V, BLOCK_V):
        x = tl.load(row_ptr + start + offs, mask=start + offs < V, other=float("-inf")).to(tl.float32)
        running_max = tl.maximum(running_max, x)
    row_max = tl.max(running_max, axis=0)
    running_sum = tl.zeros((BLOCK_V,), tl.float32)
    for start in range(0, V, BLOCK_V):
        x = tl.load(row_ptr + start + offs, mask=start + offs < V, other=float("-inf")).to(tl.float32)
        running_sum += tl.exp(x - row_max)
    return row_max, tl.log(tl.sum(running_sum, axis=0))


@cached_launch
@triton.jit
def _log_softmax_kernel(x_ptr, out_ptr, V, stride_x, stride_o, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = x_ptr + row * stride_x
    row_max, log_sum = _row_max_and_log_sum(row_ptr, V, BLOCK_V)
    offs = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        mask = start + offs < V
        x = tl.load(row_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + start + offs, (x - row_max) - log_sum, mask=mask)


@cached_launch
@triton.jit
def _logprobs_kernel(x_ptr, ids_ptr, out_ptr, V, stride_x, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = x_ptr + row * stride_x
    row_max, log_sum = _row_max_and_log_sum(row_ptr, V, BLOCK_V)
    token = tl.load(ids_ptr + row)
    valid = (token >= 0) & (token < V)  # else NaN (no host check: it would synchronise)
    picked = tl.load(row_ptr + tl.where(valid, token, 0)).to(tl.float32)
    tl.store(out_ptr + row, tl.where(valid, (picked - row_max) - log_sum, float("nan")))


@cached_launch
@triton.jit
def _logprobs_backward_kernel(x_ptr, grad_ptr, ids_ptr, out_ptr, V, stride_x, stride_o, BLOCK_V: tl.constexpr,
                              EXACT_EXP: tl.constexpr):
    """out[t, v] = round(-(exp(ls[t, v]) * grad[t])), and round(-(exp * grad) + grad) at v = ids[t], where ls is
    _log_softmax_kernel's value (the same row statistics and subtraction, so the same fp32 bits) and exp is
    CUDA's expf (libdevice, no flush to zero: torch's exp on the GPU), each step one IEEE operation (launched
    without FMA contraction). The interpreter has no libdevice: tl.exp there (EXACT_EXP off)."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = x_ptr + row * stride_x
    row_max, log_sum = _row_max_and_log_sum(row_ptr, V, BLOCK_V)
    grad = tl.load(grad_ptr + row)
    token = tl.load(ids_ptr + row)
    offs = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        mask = cols < V
        log_softmax = (tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32) - row_max) - log_sum
        if EXACT_EXP:
            exp = libdevice.exp(log_softmax)
        else:
            exp = tl.exp(log_softmax)
        # neg as torch's: the sign bit flipped (Triton's unary minus is 0 - x on the H200, +0.0 where neg gives -0.0)
        out = ((exp * grad).to(tl.int32, bitcast=True) ^ -2147483648).to(tl.float32, bitcast=True)
        # grad + out, not out + grad: equal values (on the GPU a NaN sum is canonical either way), and the NaN a host
        # torch add of (out, grad) keeps, so the interpreter reproduces the CPU bits of the replaced steps too
        out = tl.where(cols == token, grad + out, out)
        tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def row_config(vocab: int) -> dict:
    """The one place a row kernel's launch shape is chosen, from V only: BLOCK_V and the warps fix the order of the
    row sums, so every kernel that computes a row's statistics (forward and backward) launches with it."""
    return dict(BLOCK_V=min(4096, triton.next_power_of_2(vocab)), num_warps=8)


def log_softmax(logits_TV: torch.Tensor) -> torch.Tensor:
    """[T, V] float -> fp32 [T, V]."""
    logits_TV = last_dim_contiguous(logits_TV)
    num_rows, vocab = logits_TV.shape
    out_TV = torch.empty(num_rows, vocab, dtype=torch.float32, device=logits_TV.device)
    if num_rows:
        _log_softmax_kernel[(num_rows,)](logits_TV, out_TV, vocab, logits_TV.stride(0), out_TV.stride(0),
                                         **row_config(vocab))
    return out_TV


def logprobs(logits_TV: torch.Tensor, token_ids_T: torch.Tensor) -> torch.Tensor:
    """[T, V] float, [T] int -> fp32 [T], bitwise equal to log_softmax(logits)[t, token_ids[t]]; NaN where
    token_ids[t] lies outside [0, V)."""
    logits_TV = last_dim_contiguous(logits_TV)
    num_rows, vocab = logits_TV.shape
    out_T = torch.empty(num_rows, dtype=torch.float32, device=logits_TV.device)
    if num_rows:
        _logprobs_kernel[(num_rows,)](logits_TV, token_ids_T.long().contiguous(), out_T, vocab, logits_TV.stride(0),
                                      **row_config(vocab))
    return out_T


def logprobs_backward(logits_TV: torch.Tensor, grad_T: torch.Tensor, token_ids_T: torch.Tensor) -> torch.Tensor:
    """d logits [T, V] in the logits' dtype of logprobs = x[id] - lse(x): -softmax * grad, plus grad at the token.

    logits_TV: [T, V] float; grad_T: fp32 [T]; token_ids_T: int64 [T] in [0, V).
    One kernel, one program per row: the row's statistics as the forward computes them, then each element's
    gradient written once; no fp32 [T, V] is made. On the GPU the bits of the torch steps it replaces:
    ls = log_softmax(logits) (this module's kernel); d = ls.exp_().mul_(grad_T[:, None]).neg_();
    d[t, id] += grad[t] (gather, add, scatter); d.to(logits' dtype) (tests/helpers/torch_backwards.py).
    """
    logits_TV = last_dim_contiguous(logits_TV)
    num_rows, vocab = logits_TV.shape
    out_TV = torch.empty(num_rows, vocab, dtype=logits_TV.dtype, device=logits_TV.device)
    if out_TV.numel():
        _logprobs_backward_kernel[(num_rows,)](
            logits_TV, grad_T.contiguous(), token_ids_T.contiguous(), out_TV, vocab, logits_TV.stride(0),
            out_TV.stride(0), EXACT_EXP=not INTERPRET, enable_fp_fusion=False, enable_reflect_ftz=False,
            **row_config(vocab))
    return out_TV
