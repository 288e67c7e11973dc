"""mok.route: the one routing definition (DESIGN.md), as differentiable custom ops.

Legend: T tokens, E experts, K top-k.

softmax of the router logits in fp32 -> top-k by value, ties to the lower expert index -> if
renormalize, divide by the sum of the k weights (in order k = 0..K-1) in fp32 -> fp32 weights.
CPU: mok/reference/moe.py; CUDA: a Triton kernel (mok/kernels/moe.py), one program per token.
The weights are differentiable w.r.t. the logits; the ids are not.
"""
from __future__ import annotations

import torch

from mok import hooks
from mok.errors import UnsupportedError
from mok.reference import moe as reference

_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_logits(router_logits_TE: torch.Tensor, top_k: int) -> None:
    if not isinstance(router_logits_TE, torch.Tensor):
        raise UnsupportedError(f"router_logits must be a tensor, got {type(router_logits_TE).__name__}")
    if router_logits_TE.dim() != 2:
        raise UnsupportedError(f"router_logits must be [num_tokens, num_experts], got shape {tuple(router_logits_TE.shape)}")
    if router_logits_TE.dtype not in _LOGIT_DTYPES:
        raise UnsupportedError(f"router_logits dtype {router_logits_TE.dtype} is not supported (float32, bfloat16, float16)")
    if router_logits_TE.device.type not in ("cpu", "cuda"):
        raise UnsupportedError(f"device {router_logits_TE.device} is not supported (cpu, cuda)")
    num_experts = router_logits_TE.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise UnsupportedError(f"top_k must be an int in [1, {num_experts}], got {top_k!r}")


def _check_ids(topk_ids_TK: torch.Tensor, num_tokens: int, top_k: int, num_experts: int, device: torch.device) -> None:
    if not isinstance(topk_ids_TK, torch.Tensor) or topk_ids_TK.dtype not in (torch.int32, torch.int64):
        raise UnsupportedError("topk_ids must be an int32 or int64 tensor")
    if tuple(topk_ids_TK.shape) != (num_tokens, top_k):
        raise UnsupportedError(f"topk_ids must have shape {(num_tokens, top_k)}, got {tuple(topk_ids_TK.shape)}")
    if topk_ids_TK.device != device:
        raise UnsupportedError(f"topk_ids is on {topk_ids_TK.device}, expected {device}")
    # A range check needs the values on the host: free on the CPU, a sync on CUDA (skipped there).
    if topk_ids_TK.device.type == "cpu" and topk_ids_TK.numel() and not torch.compiler.is_compiling():
        lo, hi = int(topk_ids_TK.min()), int(topk_ids_TK.max())
        if lo < 0 or hi >= num_experts:
            raise UnsupportedError(f"topk_ids must lie in [0, {num_experts}), got values in [{lo}, {hi}]")


# ---------------------------------------------------------------------------------------------
# custom ops


@torch.library.custom_op("mok::route", mutates_args=())
def _route_op(router_logits_TE: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (topk_ids int32 [T, K], topk_weights fp32 [T, K], probs fp32 [T, E])."""
    return reference.route(router_logits_TE, top_k, renormalize)


@_route_op.register_kernel("cuda")
def _route_cuda(router_logits_TE, top_k, renormalize):
    from mok.kernels import moe as kernels

    return kernels.route(router_logits_TE, top_k, renormalize)


@_route_op.register_fake
def _route_fake(router_logits_TE, top_k, renormalize):
    num_tokens, num_experts = router_logits_TE.shape
    new = router_logits_TE.new_empty
    return (new((num_tokens, top_k), dtype=torch.int32), new((num_tokens, top_k), dtype=torch.float32),
            new((num_tokens, num_experts), dtype=torch.float32))


def _route_setup_context(ctx, inputs, output):
    router_logits_TE, _, renormalize = inputs
    ids_TK, weights_TK, probs_TE = output
    ctx.save_for_backward(probs_TE, ids_TK, weights_TK)
    ctx.renormalize = renormalize
    ctx.logits_dtype = router_logits_TE.dtype
    ctx.mark_non_differentiable(ids_TK, probs_TE)


def _route_backward(ctx, grad_ids, grad_weights_TK, grad_probs):
    if grad_weights_TK is None:
        return None, None, None
    probs_TE, ids_TK, weights_TK = ctx.saved_tensors
    grad_logits_TE = reference.route_backward(grad_weights_TK, probs_TE, ids_TK, weights_TK, ctx.renormalize)
    return grad_logits_TE.to(ctx.logits_dtype), None, None


_route_op.register_autograd(_route_backward, setup_context=_route_setup_context)


@torch.library.custom_op("mok::route_replay", mutates_args=())
def _replay_op(router_logits_TE: torch.Tensor, topk_ids_TK: torch.Tensor, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights of given experts: -> (topk_weights fp32 [T, K], probs fp32 [T, E])."""
    return reference.replay_weights(router_logits_TE, topk_ids_TK, renormalize)


@_replay_op.register_kernel("cuda")
def _replay_cuda(router_logits_TE, topk_ids_TK, renormalize):
    from mok.kernels import moe as kernels

    return kernels.replay_weights(router_logits_TE, topk_ids_TK, renormalize)


@_replay_op.register_fake
def _replay_fake(router_logits_TE, topk_ids_TK, renormalize):
    new = router_logits_TE.new_empty
    return new(tuple(topk_ids_TK.shape), dtype=torch.float32), new(tuple(router_logits_TE.shape), dtype=torch.float32)


def _replay_setup_context(ctx, inputs, output):
    router_logits_TE, ids_TK, renormalize = inputs
    weights_TK, probs_TE = output
    ctx.save_for_backward(probs_TE, ids_TK, weights_TK)
    ctx.renormalize = renormalize
    ctx.logits_dtype = router_logits_TE.dtype
    ctx.mark_non_differentiable(probs_TE)


def _replay_backward(ctx, grad_weights_TK, grad_probs):
    if grad_weights_TK is None:
        return None, None, None
    probs_TE, ids_TK, weights_TK = ctx.saved_tensors
    grad_logits_TE = reference.route_backward(grad_weights_TK, probs_TE, ids_TK, weights_TK, ctx.renormalize)
    return grad_logits_TE.to(ctx.logits_dtype), None, None


_replay_op.register_autograd(_replay_backward, setup_context=_replay_setup_context)


# ---------------------------------------------------------------------------------------------
# public API


def route(router_logits_TE: torch.Tensor, top_k: int, renormalize: bool = True, *,
          name: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Route tokens to experts.

    router_logits_TE: [num_tokens, num_experts], float32/bfloat16/float16, CPU or CUDA.
    Returns (topk_ids int32 [num_tokens, top_k], topk_weights fp32 [num_tokens, top_k]), experts in
    descending weight order (ties: lower expert index first). topk_weights is differentiable w.r.t.
    the logits. With `name` and an observer, emits the logits ("input") and the weights ("output").
    """
    _check_logits(router_logits_TE, top_k)
    if name is not None and hooks.observed():
        hooks.emit(name, router_logits_TE, "input")
    ids_TK, weights_TK, _ = _route_op(router_logits_TE.contiguous(), top_k, bool(renormalize))
    if name is not None and hooks.observed():
        hooks.emit(name, weights_TK, "output")
    return ids_TK, weights_TK


def replay_weights(router_logits_TE: torch.Tensor, topk_ids_TK: torch.Tensor, renormalize: bool = True) -> torch.Tensor:
    """Routing weights of given experts (routing replay): fp32 [num_tokens, top_k], differentiable
    w.r.t. the logits; equal to route()'s weights when topk_ids are route()'s ids."""
    top_k = topk_ids_TK.shape[-1] if isinstance(topk_ids_TK, torch.Tensor) and topk_ids_TK.dim() == 2 else -1
    _check_logits(router_logits_TE, max(top_k, 1))
    _check_ids(topk_ids_TK, router_logits_TE.shape[0], top_k, router_logits_TE.shape[1], router_logits_TE.device)
    weights_TK, _ = _replay_op(router_logits_TE.contiguous(), topk_ids_TK.contiguous(), bool(renormalize))
    return weights_TK
