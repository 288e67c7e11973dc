"""mok.route_grouped: the routing of the DeepSeek-V3 family and GLM-4.5 (docs/contracts.md, "Grouped routing"), as
differentiable custom ops.

Shapes: docs/shapes.md. sigmoid scores in fp32; a correction bias added for the choice only; group-limited top-k
(groups scored by the sum of their two best choice scores, ties to the lower group, then the lower expert index);
the weights are the unbiased scores of the chosen experts, renormalized (+ 1e-20, as transformers) and scaled.
CPU: mok/reference/grouped_routing.py (the default implementation of each op); CUDA: the Triton kernels of
mok/kernels/moe/grouped_routing.py (registered with register_kernel("cuda")), one program per token.
The weights are differentiable w.r.t. the logits; the ids and the bias are not. The backward is the custom op
`mok::route_grouped_backward` (its own Triton kernel on CUDA; an op so that torch.compile keeps its bits).
"""
from __future__ import annotations

import torch

from mok import hooks
from mok.errors import UnsupportedError
from mok.ops import dispatch
from mok.ops.checks import (
    FLOAT_DTYPES,
    check_bool,
    check_int,
    check_name,
    check_real,
    check_router_logits,
    check_tensor,
    check_topk_ids,
)
from mok.reference import grouped_routing as reference

# ---------------------------------------------------------------------------------------------
# custom ops


@torch.library.custom_op("mok::route_grouped", mutates_args=())
def _route_grouped_op(logits_TE: torch.Tensor, bias_E: torch.Tensor | None, top_k: int, n_group: int,
                      topk_group: int, renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (topk_ids int32 [T, K], topk_weights fp32 [T, K])."""
    return reference.route_grouped(logits_TE, bias_E, top_k, n_group, topk_group, renormalize, scaling)


def _route_grouped_cuda(logits_TE, bias_E, top_k, n_group, topk_group, renormalize, scaling):
    from mok.kernels.moe import grouped_routing as kernels

    return kernels.launch_route_grouped(logits_TE, bias_E, top_k, n_group, topk_group, renormalize, scaling)


@_route_grouped_op.register_fake
def _route_grouped_fake(logits_TE, bias_E, top_k, n_group, topk_group, renormalize, scaling):
    new = logits_TE.new_empty
    num_tokens = logits_TE.shape[0]
    return new((num_tokens, top_k), dtype=torch.int32), new((num_tokens, top_k), dtype=torch.float32)


@torch.library.custom_op("mok::route_grouped_replay", mutates_args=())
def _replay_op(logits_TE: torch.Tensor, bias_E: torch.Tensor | None, topk_ids_TK: torch.Tensor, n_group: int,
               topk_group: int, renormalize: bool, scaling: float) -> torch.Tensor:
    """Weights fp32 [T, K] of given experts (the bias and the groups only decide whether a row is undefined)."""
    return reference.replay_grouped(logits_TE, bias_E, topk_ids_TK, n_group, topk_group, renormalize, scaling)


def _replay_cuda(logits_TE, bias_E, topk_ids_TK, n_group, topk_group, renormalize, scaling):
    from mok.kernels.moe import grouped_routing as kernels

    return kernels.launch_route_grouped(logits_TE, bias_E, topk_ids_TK.shape[1], n_group, topk_group, renormalize,
                                        scaling, topk_ids_TK)[1]


@_replay_op.register_fake
def _replay_fake(logits_TE, bias_E, topk_ids_TK, n_group, topk_group, renormalize, scaling):
    return logits_TE.new_empty(tuple(topk_ids_TK.shape), dtype=torch.float32)


@torch.library.custom_op("mok::route_grouped_backward", mutates_args=())
def _backward_op(grad_weights_TK: torch.Tensor, logits_TE: torch.Tensor, ids_TK: torch.Tensor,
                 weights_TK: torch.Tensor, renormalize: bool, scaling: float) -> torch.Tensor:
    """d logits fp32 [T, E] from d topk_weights [T, K] (mok/reference/grouped_routing.py's route_grouped_backward)."""
    return reference.route_grouped_backward(grad_weights_TK, logits_TE, ids_TK, weights_TK, renormalize, scaling)


def _backward_cuda(grad_weights_TK, logits_TE, ids_TK, weights_TK, renormalize, scaling):
    from mok.kernels.moe import grouped_routing as kernels

    return kernels.launch_route_grouped_backward(grad_weights_TK.contiguous(), logits_TE, ids_TK, weights_TK,
                                                 renormalize, scaling)


@_backward_op.register_fake
def _backward_fake(grad_weights_TK, logits_TE, ids_TK, weights_TK, renormalize, scaling):
    return logits_TE.new_empty(tuple(logits_TE.shape), dtype=torch.float32)


def _save(ctx, logits_TE, ids_TK, weights_TK, renormalize, scaling) -> None:
    ctx.save_for_backward(logits_TE, ids_TK, weights_TK)
    ctx.set_materialize_grads(False)  # only the weights' gradient is read (None when they got none)
    ctx.renormalize, ctx.scaling = renormalize, scaling


def _route_setup_context(ctx, inputs, output):
    logits_TE, _, _, _, _, renormalize, scaling = inputs
    ids_TK, weights_TK = output
    _save(ctx, logits_TE, ids_TK, weights_TK, renormalize, scaling)
    ctx.mark_non_differentiable(ids_TK)


def _replay_setup_context(ctx, inputs, output):
    logits_TE, _, ids_TK, _, _, renormalize, scaling = inputs
    _save(ctx, logits_TE, ids_TK, output, renormalize, scaling)


def _weights_backward(ctx, *grads):
    """The one backward of both ops (7 inputs each): d logits from d topk_weights, the last output of both."""
    grad_weights_TK = grads[-1]
    if grad_weights_TK is None:
        return (None,) * 7
    logits_TE, ids_TK, weights_TK = ctx.saved_tensors
    grad_logits_TE = _backward(grad_weights_TK, logits_TE, ids_TK, weights_TK, ctx.renormalize, ctx.scaling)
    return (grad_logits_TE.to(logits_TE.dtype), *(None,) * 6)


_route_grouped = dispatch.register(_route_grouped_op, cuda=_route_grouped_cuda, backward=_weights_backward,
                                   setup_context=_route_setup_context)
_replay = dispatch.register(_replay_op, cuda=_replay_cuda, backward=_weights_backward,
                            setup_context=_replay_setup_context)
_backward = dispatch.register(_backward_op, cuda=_backward_cuda)


# ---------------------------------------------------------------------------------------------
# public API


def _check_groups(num_experts: int, top_k: int, n_group, topk_group) -> tuple[int, int]:
    """(n_group, topk_group) of a valid group-limited routing of num_experts experts, top_k of them per token."""
    n_group = check_int(n_group, "route_grouped: n_group")
    topk_group = check_int(topk_group, "route_grouped: topk_group")
    if n_group < 1 or num_experts % n_group:
        raise UnsupportedError(f"route_grouped: n_group must be >= 1 and divide the {num_experts} experts, "
                               f"got {n_group}")
    if not 1 <= topk_group <= n_group:
        raise UnsupportedError(f"route_grouped: topk_group must be in [1, n_group = {n_group}], got {topk_group}")
    group_size = num_experts // n_group
    if topk_group < n_group and group_size < 2:
        raise UnsupportedError(f"route_grouped: a group is scored by its two best experts, so groups need >= 2 "
                               f"experts, got {num_experts} experts in {n_group} groups")
    if top_k > topk_group * group_size:
        raise UnsupportedError(f"route_grouped: top_k = {top_k} is more than the {topk_group * group_size} experts "
                               f"of the topk_group = {topk_group} kept groups of {group_size}")
    return n_group, topk_group


def _check_bias(bias_E, num_experts: int, device: torch.device) -> torch.Tensor | None:
    """The correction bias as fp32 [E] contiguous, detached (it carries no gradient), or None."""
    if bias_E is None:
        return None
    check_tensor(bias_E, "route_grouped: bias_E")
    if bias_E.dtype not in FLOAT_DTYPES:
        raise UnsupportedError(f"route_grouped: bias_E dtype {bias_E.dtype} is not supported "
                               "(float32, bfloat16, float16; widened to float32)")
    if tuple(bias_E.shape) != (num_experts,) or bias_E.device != device:
        raise UnsupportedError(f"route_grouped: bias_E must be [{num_experts}] on {device}, "
                               f"got {tuple(bias_E.shape)} on {bias_E.device}")
    return bias_E.detach().float().contiguous()


_FP32_OVERFLOW = (2 - 2**-24) * 2**127  # halfway between fp32's largest finite value and 2**128: rounds to inf


def _check_scaling(scaling) -> float:
    """A finite real that stays finite in fp32 (the weights are multiplied by its fp32 rounding)."""
    scaling = check_real(scaling, "route_grouped: scaling")
    if abs(scaling) >= _FP32_OVERFLOW:
        raise UnsupportedError(f"route_grouped: scaling must be finite in float32, got {scaling!r}")
    return scaling


def route_grouped(logits_TE: torch.Tensor, top_k: int, *, n_group: int = 1, topk_group: int = 1,
                  bias_E: torch.Tensor | None = None, renormalize: bool = True, scaling: float = 1.0,
                  topk_ids: torch.Tensor | None = None, name: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Route tokens to experts the DeepSeek-V3 / GLM-4.5 way (transformers' DeepseekV3TopkRouter).

    logits_TE: [num_tokens, num_experts], float32/bfloat16/float16, CPU or CUDA. n_group groups of E / n_group
    experts, of which the topk_group best are kept; bias_E (`e_score_correction_bias`, [E] float) is added to the
    sigmoid scores to choose the experts only; renormalize (`norm_topk_prob`); scaling (`routed_scaling_factor`).
    Returns (topk_ids int32 [num_tokens, top_k] in descending choice-score order, ties to the lower index;
    topk_weights fp32 [num_tokens, top_k]), the weights differentiable w.r.t. the logits. Routing replay: with
    topk_ids (int32/int64 [T, K]) those ids come back with their weights, computed the same way. A token of undefined
    routing (a NaN choice or group score) gets ids 0..K-1 (not in replay) and NaN weights.
    With `name` and an observer, emits the logits ("input") and the weights ("output").
    """
    check_router_logits(logits_TE, top_k)
    num_tokens, num_experts = logits_TE.shape
    n_group, topk_group = _check_groups(num_experts, top_k, n_group, topk_group)
    bias_E = _check_bias(bias_E, num_experts, logits_TE.device)
    renormalize = check_bool(renormalize, "route_grouped: renormalize")
    scaling = _check_scaling(scaling)
    check_name(name, "route_grouped")
    if name is not None and hooks.observed():
        hooks.emit(name, logits_TE, "input")
    logits_TE = logits_TE.contiguous()
    if topk_ids is None:
        ids_TK, weights_TK = _route_grouped(logits_TE, bias_E, top_k, n_group, topk_group, renormalize, scaling)
    else:
        check_topk_ids(topk_ids, num_tokens, top_k, num_experts, logits_TE.device)
        ids_TK = topk_ids
        weights_TK = _replay(logits_TE, bias_E, topk_ids.contiguous(), n_group, topk_group, renormalize, scaling)
    if name is not None and hooks.observed():
        hooks.emit(name, weights_TK, "output")
    return ids_TK, weights_TK
