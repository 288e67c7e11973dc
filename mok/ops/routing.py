"""mok.route: the one routing definition (docs/contracts.md, "Routing"), as differentiable custom ops.

Shapes: docs/shapes.md.

softmax of the router logits in fp32 -> top-k by value, ties to the lower expert index -> if
renormalize, divide by the sum of the k weights (in order k = 0..K-1) in fp32 -> fp32 weights.
CPU: mok/reference/moe.py (the default implementation of each op); CUDA: the Triton kernel of
mok/kernels/moe/routing.py (registered with register_kernel("cuda")), one program per token.
A token whose routing is undefined (a NaN probability: NaN or +Inf logit, all logits -Inf) gets experts
0..K-1 and NaN weights on both paths, without an error or a host sync (docs/contracts.md, "Routing").
The weights are differentiable w.r.t. the logits; the ids are not. The backward is the custom op
`mok::route_backward` (torch ops on both devices; an op so that torch.compile keeps its bits).
"""
from __future__ import annotations

import torch

from mok import hooks
from mok.ops import dispatch
from mok.ops.checks import check_bool, check_name, check_router_logits, check_topk_ids
from mok.reference import moe as reference

# ---------------------------------------------------------------------------------------------
# custom ops


@torch.library.custom_op("mok::route", mutates_args=())
def _route_op(router_logits_TE: torch.Tensor, top_k: int,
              renormalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (topk_ids int32 [T, K], topk_weights fp32 [T, K], probs fp32 [T, E])."""
    return reference.route(router_logits_TE, top_k, renormalize)


def _route_cuda(router_logits_TE, top_k, renormalize):
    from mok.kernels import moe as kernels

    return kernels.route(router_logits_TE, top_k, renormalize)


@_route_op.register_fake
def _route_fake(router_logits_TE, top_k, renormalize):
    num_tokens, num_experts = router_logits_TE.shape
    new = router_logits_TE.new_empty
    return (new((num_tokens, top_k), dtype=torch.int32), new((num_tokens, top_k), dtype=torch.float32),
            new((num_tokens, num_experts), dtype=torch.float32))


@torch.library.custom_op("mok::route_replay", mutates_args=())
def _replay_op(router_logits_TE: torch.Tensor, topk_ids_TK: torch.Tensor,
               renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights of given experts: -> (topk_weights fp32 [T, K], probs fp32 [T, E])."""
    return reference.replay_weights(router_logits_TE, topk_ids_TK, renormalize)


def _replay_cuda(router_logits_TE, topk_ids_TK, renormalize):
    from mok.kernels import moe as kernels

    return kernels.replay_weights(router_logits_TE, topk_ids_TK, renormalize)


@_replay_op.register_fake
def _replay_fake(router_logits_TE, topk_ids_TK, renormalize):
    new = router_logits_TE.new_empty
    return new(tuple(topk_ids_TK.shape), dtype=torch.float32), new(tuple(router_logits_TE.shape), dtype=torch.float32)


@torch.library.custom_op("mok::route_backward", mutates_args=())
def _route_backward_op(grad_weights_TK: torch.Tensor, probs_TE: torch.Tensor, ids_TK: torch.Tensor,
                       weights_TK: torch.Tensor, renormalize: bool) -> torch.Tensor:
    """d logits fp32 [T, E] from d topk_weights [T, K]: mok/reference/moe.py's route_backward (torch ops, both
    devices). An op of its own so that torch.compile runs it as it is, with the eager bits, instead of
    compiling its reductions in another order."""
    return reference.route_backward(grad_weights_TK, probs_TE, ids_TK, weights_TK, renormalize)


@_route_backward_op.register_fake
def _route_backward_fake(grad_weights_TK, probs_TE, ids_TK, weights_TK, renormalize):
    return torch.empty_like(probs_TE)


def _save_for_weights_backward(ctx, router_logits_TE, ids_TK, weights_TK, probs_TE, renormalize) -> None:
    ctx.save_for_backward(probs_TE, ids_TK, weights_TK)
    ctx.set_materialize_grads(False)  # only the weights' gradient is read (None when they got none): no zero tensors
    ctx.renormalize = renormalize
    ctx.logits_dtype = router_logits_TE.dtype


def _route_setup_context(ctx, inputs, output):
    router_logits_TE, _, renormalize = inputs
    ids_TK, weights_TK, probs_TE = output
    _save_for_weights_backward(ctx, router_logits_TE, ids_TK, weights_TK, probs_TE, renormalize)
    ctx.mark_non_differentiable(ids_TK, probs_TE)


def _replay_setup_context(ctx, inputs, output):
    router_logits_TE, ids_TK, renormalize = inputs
    weights_TK, probs_TE = output
    _save_for_weights_backward(ctx, router_logits_TE, ids_TK, weights_TK, probs_TE, renormalize)
    ctx.mark_non_differentiable(probs_TE)


def _weights_backward(ctx, *grads):
    """The one backward of both ops: d logits from d topk_weights. Both return (..., weights, probs),
    so the weights' gradient is grads[-2]; both take (logits, top_k or ids, renormalize)."""
    grad_weights_TK = grads[-2]
    if grad_weights_TK is None:
        return None, None, None
    probs_TE, ids_TK, weights_TK = ctx.saved_tensors
    grad_logits_TE = _route_backward(grad_weights_TK, probs_TE, ids_TK, weights_TK, ctx.renormalize)
    return grad_logits_TE.to(ctx.logits_dtype), None, None


_route = dispatch.register(_route_op, cuda=_route_cuda, backward=_weights_backward, setup_context=_route_setup_context)
_replay = dispatch.register(_replay_op, cuda=_replay_cuda, backward=_weights_backward,
                            setup_context=_replay_setup_context)
_route_backward = dispatch.register(_route_backward_op)


# ---------------------------------------------------------------------------------------------
# public API


def route(router_logits_TE: torch.Tensor, top_k: int, renormalize: bool = True, *,
          name: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Route tokens to experts.

    router_logits_TE: [num_tokens, num_experts], float32/bfloat16/float16, CPU or CUDA.
    Returns (topk_ids int32 [num_tokens, top_k], topk_weights fp32 [num_tokens, top_k]), experts in
    descending weight order (ties: lower expert index first). topk_weights is differentiable w.r.t.
    the logits. A token of undefined routing (NaN probabilities) gets ids 0..K-1 and NaN weights.
    With `name` and an observer, emits the logits ("input") and the weights ("output").
    """
    check_name(name, "route")
    check_router_logits(router_logits_TE, top_k)
    if name is not None and hooks.observed():
        hooks.emit(name, router_logits_TE, "input")
    ids_TK, weights_TK, _ = _route(router_logits_TE.contiguous(), top_k, check_bool(renormalize, "route: renormalize"))
    if name is not None and hooks.observed():
        hooks.emit(name, weights_TK, "output")
    return ids_TK, weights_TK


def replay_weights(router_logits_TE: torch.Tensor, topk_ids_TK: torch.Tensor, renormalize: bool = True) -> torch.Tensor:
    """Routing weights of given experts (routing replay): fp32 [num_tokens, top_k], differentiable
    w.r.t. the logits; equal to route()'s weights when topk_ids are route()'s ids."""
    top_k = topk_ids_TK.shape[-1] if isinstance(topk_ids_TK, torch.Tensor) and topk_ids_TK.dim() == 2 else -1
    check_router_logits(router_logits_TE, max(top_k, 1))
    check_topk_ids(topk_ids_TK, router_logits_TE.shape[0], top_k, router_logits_TE.shape[1], router_logits_TE.device)
    weights_TK, _ = _replay(router_logits_TE.contiguous(), topk_ids_TK.contiguous(),
                            check_bool(renormalize, "replay_weights: renormalize"))
    return weights_TK
