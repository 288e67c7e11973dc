"""mok.log_softmax and mok.logprobs: fp32 log-probabilities over the vocabulary, batch-invariant.

Shapes: docs/shapes.md.
Semantics: m = row max, s = sum(exp(x - m)) in a fixed order that depends on V only,
log_softmax = (x - m) - log(s) in fp32; logprobs picks entry token_ids[t] of that row with the same
bits as the full log_softmax. Logits of any float dtype; results fp32 (what vLLM's
Sampler.compute_logprobs returns). Backward: deterministic (softmax minus one-hot, fixed-order sums).
Each op's default implementation is the CPU reference (mok/reference/logprobs.py); the CUDA kernels
are registered with register_kernel("cuda") (mok/kernels/logprobs.py; logprobs' backward: one kernel, no fp32 [T, V]).
Token ids outside [0, V) (docs/contracts.md, "Log-probabilities"): mok.logprobs raises on CPU tensors in
eager mode (the values are on the host); on CUDA and under torch.compile nothing reads them on the host
(no synchronisation, no graph break): the token's log-probability and its gradient row are NaN, on both
devices, and nothing is read or written out of bounds.
"""
from __future__ import annotations

import torch

from mok import hooks
from mok.errors import UnsupportedError
from mok.ops import dispatch
from mok.ops.checks import FLOAT_DTYPES, INT_DTYPES, check_device, check_name, check_tensor
from mok.reference import logprobs as reference


@torch.library.custom_op("mok::log_softmax", mutates_args=())
def _log_softmax_op(logits_TV: torch.Tensor) -> torch.Tensor:
    check_device(logits_TV)
    return reference.log_softmax(logits_TV)


def _log_softmax_cuda(logits_TV):
    from mok.kernels import logprobs as kernels

    return kernels.log_softmax(logits_TV)


@_log_softmax_op.register_fake
def _(logits_TV):
    return logits_TV.new_empty(logits_TV.shape, dtype=torch.float32)


def _neutralize_ids(token_ids_T: torch.Tensor, values_T: torch.Tensor, vocab: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids with those outside [0, vocab) replaced by 0, values with NaN at those tokens): device ops, no sync."""
    valid_T = (token_ids_T >= 0) & (token_ids_T < vocab)
    return torch.where(valid_T, token_ids_T, 0), torch.where(valid_T, values_T, float("nan"))


@torch.library.custom_op("mok::logprobs", mutates_args=())
def _logprobs_op(logits_TV: torch.Tensor, token_ids_T: torch.Tensor) -> torch.Tensor:
    check_device(logits_TV, token_ids_T)
    vocab = logits_TV.shape[1]
    valid_T = (token_ids_T >= 0) & (token_ids_T < vocab)
    out_T = reference.logprobs(logits_TV, torch.where(valid_T, token_ids_T, 0))
    return torch.where(valid_T, out_T, float("nan"))


def _logprobs_cuda(logits_TV, token_ids_T):
    check_device(logits_TV, token_ids_T)
    from mok.kernels import logprobs as kernels

    return kernels.logprobs(logits_TV, token_ids_T)


@_logprobs_op.register_fake
def _(logits_TV, token_ids_T):
    return logits_TV.new_empty(logits_TV.shape[0], dtype=torch.float32)


@torch.library.custom_op("mok::log_softmax_backward", mutates_args=())
def _log_softmax_backward_op(grad_TV: torch.Tensor, log_softmax_TV: torch.Tensor) -> torch.Tensor:
    return reference.log_softmax_backward(grad_TV, log_softmax_TV)


def _log_softmax_backward_cuda(grad_TV, log_softmax_TV):
    grad_TV = grad_TV.float()
    return grad_TV - torch.exp(log_softmax_TV) * grad_TV.sum(-1, keepdim=True)


@_log_softmax_backward_op.register_fake
def _(grad_TV, log_softmax_TV):
    return torch.empty_like(log_softmax_TV)


def _setup_log_softmax(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.logits_dtype = inputs[0].dtype


def _backward_log_softmax(ctx, grad_TV):
    (log_softmax_TV,) = ctx.saved_tensors
    return _log_softmax_backward(grad_TV.contiguous(), log_softmax_TV).to(ctx.logits_dtype)


@torch.library.custom_op("mok::logprobs_backward", mutates_args=())
def _logprobs_backward_op(grad_T: torch.Tensor, logits_TV: torch.Tensor, token_ids_T: torch.Tensor) -> torch.Tensor:
    """d/dx of x[id] - lse(x) = onehot(id) - softmax(x), times grad_T -> [T, V] in the logits' dtype."""
    log_softmax_TV = reference.log_softmax(logits_TV)
    # an id outside [0, V): a NaN gradient there makes the token's whole row NaN (the row sum is NaN)
    token_ids_T, grad_T = _neutralize_ids(token_ids_T, grad_T.float(), logits_TV.shape[1])
    grad_TV = torch.zeros_like(log_softmax_TV).scatter(1, token_ids_T[:, None], grad_T[:, None])
    return reference.log_softmax_backward(grad_TV, log_softmax_TV).to(logits_TV.dtype)


def _logprobs_backward_cuda(grad_T, logits_TV, token_ids_T):
    # One kernel from the logits (the row's statistics again, then each gradient element written once): the bits
    # of exp_().mul_(grad).neg_(), the token's gather/add/scatter and .to(dtype) on the log_softmax, without an
    # fp32 [T, V] (mok/kernels/logprobs.py).
    from mok.kernels import logprobs as kernels

    # an id outside [0, V): a NaN gradient there makes the token's whole row NaN
    token_ids_T, grad_T = _neutralize_ids(token_ids_T, grad_T.float(), logits_TV.shape[1])
    return kernels.logprobs_backward(logits_TV, grad_T, token_ids_T)


@_logprobs_backward_op.register_fake
def _(grad_T, logits_TV, token_ids_T):
    return torch.empty_like(logits_TV)


def _setup_logprobs(ctx, inputs, output):
    logits_TV, token_ids_T = inputs
    ctx.save_for_backward(logits_TV, token_ids_T)


def _backward_logprobs(ctx, grad_T):
    logits_TV, token_ids_T = ctx.saved_tensors
    # recomputing the log_softmax in the backward keeps no fp32 [T, V] alive between forward and backward
    return _logprobs_backward(grad_T.contiguous(), logits_TV, token_ids_T), None


_log_softmax = dispatch.register(_log_softmax_op, cuda=_log_softmax_cuda, backward=_backward_log_softmax,
                                 setup_context=_setup_log_softmax)
_logprobs = dispatch.register(_logprobs_op, cuda=_logprobs_cuda, backward=_backward_logprobs,
                              setup_context=_setup_logprobs)
_log_softmax_backward = dispatch.register(_log_softmax_backward_op, cuda=_log_softmax_backward_cuda)
_logprobs_backward = dispatch.register(_logprobs_backward_op, cuda=_logprobs_backward_cuda)


def _check_vocab_logits(logits_TV: torch.Tensor, op: str) -> None:
    check_tensor(logits_TV, f"{op}: logits")
    check_device(logits_TV)
    if logits_TV.dtype not in FLOAT_DTYPES:
        raise UnsupportedError(f"{op}: dtype {logits_TV.dtype} not in {FLOAT_DTYPES}")
    if logits_TV.dim() != 2 or logits_TV.shape[1] == 0:
        raise UnsupportedError(f"{op}: logits must be [T, V] with V > 0, got {tuple(logits_TV.shape)}")


def log_softmax(logits_TV: torch.Tensor, *, name: str | None = None) -> torch.Tensor:
    """fp32 log_softmax over the last dim. logits_TV: [T, V] fp32/bf16/fp16 -> fp32 [T, V].

    Batch-invariant (a row's bits depend only on that row). Differentiable.
    `name`: when set and observed, emits (name, logits, "input") and (name, out, "output").
    """
    check_name(name, "log_softmax")
    _check_vocab_logits(logits_TV, "log_softmax")
    observed = name is not None and hooks.observed()
    if observed:
        hooks.emit(name, logits_TV, "input")
    out = _log_softmax(logits_TV.contiguous())
    if observed:
        hooks.emit(name, out, "output")
    return out


def logprobs(logits_TV: torch.Tensor, token_ids_T: torch.Tensor, *, name: str | None = None) -> torch.Tensor:
    """log_softmax(logits)[t, token_ids[t]]: logits_TV [T, V] float, token_ids_T [T] integer -> fp32 [T].

    Bitwise equal to mok.log_softmax(logits)[t, token_ids[t]]. Differentiable w.r.t. logits.
    Ids outside [0, V): UnsupportedError on CPU tensors in eager mode; on CUDA and under torch.compile
    (where the check would synchronise or break the graph) the token's result and gradient row are NaN.
    `name`: when set and observed, emits (name, logits, "input") and (name, out, "output").
    """
    check_name(name, "logprobs")
    _check_vocab_logits(logits_TV, "logprobs")
    check_tensor(token_ids_T, "logprobs: token_ids")
    if token_ids_T.shape != logits_TV.shape[:1] or token_ids_T.dtype not in INT_DTYPES:
        raise UnsupportedError(f"logprobs: token_ids must be integer [{logits_TV.shape[0]}] "
                               f"({', '.join(str(d) for d in INT_DTYPES)}), "
                               f"got {token_ids_T.dtype} {tuple(token_ids_T.shape)}")
    check_device(logits_TV, token_ids_T)
    if token_ids_T.device.type == "cpu" and token_ids_T.numel() and not torch.compiler.is_compiling():
        if int(token_ids_T.min()) < 0 or int(token_ids_T.max()) >= logits_TV.shape[1]:
            raise UnsupportedError(f"logprobs: token ids must lie in [0, {logits_TV.shape[1]})")
    observed = name is not None and hooks.observed()
    if observed:
        hooks.emit(name, logits_TV, "input")
    out = _logprobs(logits_TV.contiguous(), token_ids_T.long().contiguous())
    if observed:
        hooks.emit(name, out, "output")
    return out
