"""mok.moe: the deterministic, batch-invariant MoE layer (routing + experts + combine), differentiable.

Shapes: docs/shapes.md (slots N = T * K; gate_up and act rows in schedule order: grouped by expert,
stable by token then k).

Structure: `moe` (Python adapter: validation from sizes only, routing, hooks) -> custom op
`mok::moe_experts` (forward; default CPU implementation mok/reference/moe.py, CUDA kernel registered with
register_kernel("cuda"): mok/kernels/moe/) whose autograd calls the custom op
`mok::moe_experts_backward` (registered the same way). Routing goes through mok.route's ops, so
gradients reach the router logits through the routing weights. When nothing needs a gradient (no grad
mode, or no input requires one: inference, decode) one custom op `mok::moe_infer` routes and runs the
experts instead: the same kernels and arithmetic (same bits), one dispatch, nothing saved, one
workspace allocation on CUDA. Every op has a fake impl, so the layer traces under
torch.compile(fullgraph=True); no op reads a device value on the host, so the layer is CUDA-graph
capturable.
"""
from __future__ import annotations

import torch

from mok import hooks
from mok.errors import UnsupportedError
from mok.ops import dispatch
from mok.ops.checks import FLOAT_DTYPES, check_bool, check_name, check_router_logits, check_tensor, check_topk_ids
from mok.ops.routing import _replay, _route
from mok.reference import moe as reference

# ---------------------------------------------------------------------------------------------
# custom ops


@torch.library.custom_op("mok::moe_experts", mutates_args=())
def _experts_op(hidden_TH: torch.Tensor, w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor, topk_ids_TK: torch.Tensor,
                topk_weights_TK: torch.Tensor, save_for_backward: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (out [T, H], gate_up [N, 2I], act [N, I], y [N, H], sorted_slots int64 [N], expert_start int64 [E + 1]).

    Without save_for_backward the four saved tensors come back empty (zero rows).
    """
    out = reference.moe_forward(hidden_TH, w13_E2IH, w2_EHI, topk_ids_TK, topk_weights_TK)
    return out if save_for_backward else _drop_saved(out)


def _drop_saved(out):
    out_TH, gate_up_N2I, act_NI, y_NH, sorted_slots_N, expert_start = out
    return (out_TH, gate_up_N2I[:0].clone(), act_NI[:0].clone(), y_NH[:0].clone(), sorted_slots_N[:0].clone(),
            expert_start[:0].clone())


def _experts_cuda(hidden_TH, w13_E2IH, w2_EHI, topk_ids_TK, topk_weights_TK, save_for_backward):
    from mok.kernels import moe as kernels

    return kernels.moe_forward(hidden_TH, w13_E2IH, w2_EHI, topk_ids_TK, topk_weights_TK, save_for_backward)


@_experts_op.register_fake
def _experts_fake(hidden_TH, w13_E2IH, w2_EHI, topk_ids_TK, topk_weights_TK, save_for_backward):
    num_tokens, hidden = hidden_TH.shape
    num_experts, two_inter, _ = w13_E2IH.shape
    rows = num_tokens * topk_ids_TK.shape[1] if save_for_backward else 0
    new = hidden_TH.new_empty
    return (new((num_tokens, hidden)), new((rows, two_inter)), new((rows, two_inter // 2)), new((rows, hidden)),
            new((rows,), dtype=torch.int64), new((num_experts + 1 if save_for_backward else 0,), dtype=torch.int64))


@torch.library.custom_op("mok::moe_experts_backward", mutates_args=())
def _experts_backward_op(grad_out_TH: torch.Tensor, hidden_TH: torch.Tensor, w13_E2IH: torch.Tensor,
                         w2_EHI: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                         gate_up_N2I: torch.Tensor, act_NI: torch.Tensor, y_NH: torch.Tensor,
                         sorted_slots_N: torch.Tensor, expert_start: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (d hidden [T, H], d w13 [E, 2I, H], d w2 [E, H, I], d topk_weights fp32 [T, K])."""
    return reference.moe_backward(grad_out_TH, hidden_TH, w13_E2IH, w2_EHI, topk_ids_TK, topk_weights_TK,
                                  gate_up_N2I, act_NI, y_NH, sorted_slots_N, expert_start)


def _experts_backward_cuda(grad_out_TH, hidden_TH, w13_E2IH, w2_EHI, topk_ids_TK, topk_weights_TK,
                           gate_up_N2I, act_NI, y_NH, sorted_slots_N, expert_start):
    from mok.kernels import moe as kernels

    return kernels.moe_backward(grad_out_TH, hidden_TH, w13_E2IH, w2_EHI, topk_ids_TK, topk_weights_TK,
                                gate_up_N2I, act_NI, y_NH, sorted_slots_N, expert_start)


@_experts_backward_op.register_fake
def _experts_backward_fake(grad_out_TH, hidden_TH, w13_E2IH, w2_EHI, topk_ids_TK, topk_weights_TK,
                           gate_up_N2I, act_NI, y_NH, sorted_slots_N, expert_start):
    return (torch.empty_like(hidden_TH), torch.empty_like(w13_E2IH), torch.empty_like(w2_EHI),
            topk_weights_TK.new_empty(tuple(topk_weights_TK.shape), dtype=torch.float32))


def _experts_setup_context(ctx, inputs, output):
    hidden_TH, w13_E2IH, w2_EHI, ids_TK, weights_TK, save_for_backward = inputs
    out_TH, gate_up_N2I, act_NI, y_NH, sorted_slots_N, expert_start = output
    ctx.saved = save_for_backward
    ctx.weights_dtype = weights_TK.dtype
    ctx.save_for_backward(hidden_TH, w13_E2IH, w2_EHI, ids_TK, weights_TK, gate_up_N2I, act_NI, y_NH,
                          sorted_slots_N, expert_start)
    ctx.mark_non_differentiable(gate_up_N2I, act_NI, y_NH, sorted_slots_N, expert_start)
    # Their gradients are never read: None instead of autograd's zero tensors (N x (2I + I + H) zeros per layer).
    ctx.set_materialize_grads(False)


def _experts_backward(ctx, grad_out_TH, *grad_saved):
    if grad_out_TH is None:
        return None, None, None, None, None, None
    if torch.is_grad_enabled():  # the engine runs a backward in grad mode only for create_graph=True
        raise UnsupportedError(
            "mok.moe has no second derivative: its backward ran with create_graph=True (a gradient of a gradient: "
            "double backward, a gradient penalty, a Hessian-vector product); take first-order gradients only")
    if not ctx.saved:
        raise UnsupportedError("mok.moe: backward through a forward that ran without grad mode (nothing was saved)")
    grads = _experts_backward_eager(grad_out_TH.contiguous(), *ctx.saved_tensors)
    grad_hidden_TH, grad_w13_E2IH, grad_w2_EHI, grad_weights_TK = grads
    return grad_hidden_TH, grad_w13_E2IH, grad_w2_EHI, None, grad_weights_TK.to(ctx.weights_dtype), None


_experts = dispatch.register(_experts_op, cuda=_experts_cuda, backward=_experts_backward,
                             setup_context=_experts_setup_context)
_experts_backward_eager = dispatch.register(_experts_backward_op, cuda=_experts_backward_cuda)


@torch.library.custom_op("mok::moe_infer", mutates_args=())
def _infer_op(hidden_TH: torch.Tensor, router_logits_TE: torch.Tensor, w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor,
              topk_ids_TK: torch.Tensor | None, topk_weights_TK: torch.Tensor | None, top_k: int,
              renormalize: bool) -> torch.Tensor:
    """The forward when nothing needs a gradient -> out [T, H]: route (topk_ids None), replay the weights of
    topk_ids (topk_weights None) or take both, then the experts; what _route_op / _replay_op and
    _experts_op compute, in one op that saves nothing (no autograd: called only without gradients)."""
    if topk_ids_TK is None:
        ids_TK, weights_TK, _ = reference.route(router_logits_TE, top_k, renormalize)
    elif topk_weights_TK is None:
        ids_TK = topk_ids_TK
        weights_TK, _ = reference.replay_weights(router_logits_TE, ids_TK, renormalize)
    else:
        ids_TK, weights_TK = topk_ids_TK, topk_weights_TK
    return reference.moe_forward(hidden_TH, w13_E2IH, w2_EHI, ids_TK, weights_TK)[0]


def _infer_cuda(*args):
    """The op's CUDA kernel: calls through the op (torch.compile's graphs, its cudagraph trees) plan nothing."""
    from mok.kernels import moe as kernels

    return kernels.moe_infer(*args)


def _infer_cuda_eager(*args):
    """A plain eager call on CUDA: decode sizes replay launch plans (mok/kernels/moe/layer.py decode_plans)."""
    from mok.kernels import moe as kernels

    return kernels.moe_infer(*args, plan=True)


@_infer_op.register_fake
def _infer_fake(hidden_TH, router_logits_TE, w13_E2IH, w2_EHI, topk_ids_TK, topk_weights_TK, top_k, renormalize):
    return hidden_TH.new_empty(tuple(hidden_TH.shape))


_infer = dispatch.register(_infer_op, cuda=_infer_cuda, eager_cuda=_infer_cuda_eager, native="moe_infer")


# ---------------------------------------------------------------------------------------------
# public API


def _check_experts(hidden_TH, w13_E2IH, w2_EHI) -> None:
    for label, t in (("hidden_states", hidden_TH), ("w13", w13_E2IH), ("w2", w2_EHI)):
        check_tensor(t, label)
    if hidden_TH.device.type not in ("cpu", "cuda"):
        raise UnsupportedError(f"device {hidden_TH.device} is not supported (cpu, cuda)")
    if hidden_TH.dtype not in FLOAT_DTYPES:
        raise UnsupportedError(f"hidden_states dtype {hidden_TH.dtype} is not supported (bfloat16, float16, float32)")
    if w13_E2IH.dtype != hidden_TH.dtype or w2_EHI.dtype != hidden_TH.dtype:
        raise UnsupportedError(f"w13 ({w13_E2IH.dtype}) and w2 ({w2_EHI.dtype}) must have the dtype of hidden_states "
                               f"({hidden_TH.dtype})")
    if w13_E2IH.device != hidden_TH.device or w2_EHI.device != hidden_TH.device:
        raise UnsupportedError(f"hidden_states, w13 and w2 must be on one device, got {hidden_TH.device}, "
                               f"{w13_E2IH.device}, {w2_EHI.device}")
    if hidden_TH.dim() != 2:
        raise UnsupportedError(f"hidden_states must be [num_tokens, hidden], got shape {tuple(hidden_TH.shape)}")
    if w13_E2IH.dim() != 3 or w2_EHI.dim() != 3:
        raise UnsupportedError(
            f"w13 must be [E, 2I, H] and w2 [E, H, I], got {tuple(w13_E2IH.shape)} and {tuple(w2_EHI.shape)}")
    num_experts, two_inter, hidden = w13_E2IH.shape
    if two_inter % 2 or hidden != hidden_TH.shape[1] or tuple(w2_EHI.shape) != (num_experts, hidden, two_inter // 2):
        raise UnsupportedError(f"shapes do not match: hidden_states {tuple(hidden_TH.shape)}, "
                               f"w13 {tuple(w13_E2IH.shape)} (want [E, 2I, H]), "
                               f"w2 {tuple(w2_EHI.shape)} (want [E, H, I])")


def moe(hidden_states_TH: torch.Tensor, router_logits_TE: torch.Tensor, w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor,
        top_k: int, renormalize: bool = True, topk_ids: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None, *, name: str | None = None, ep_group=None) -> torch.Tensor:
    """The MoE layer: route, run the SwiGLU experts, combine. Deterministic and batch-invariant.

    hidden_states_TH: [T, H] bf16 (fp16/fp32 accepted); router_logits_TE: [T, E] float;
    w13_E2IH: [E, 2I, H] (gate rows, then up rows); w2_EHI: [E, H, I]; same dtype and device.
    Routing replay: pass topk_ids [T, K] (int) to fix the experts (weights then come from the
    logits, differentiably), or topk_ids and topk_weights [T, K] (float) to fix both.
    Returns [T, H] in the dtype of hidden_states. Differentiable w.r.t. hidden_states,
    router_logits (unless topk_weights is given), w13, w2 and topk_weights.
    Expert parallelism: ep_group, a torch.distributed process group of P ranks; w13 [E/P, 2I, H] and
    w2 [E/P, H, I] then hold this rank's block of experts [r * E/P, (r + 1) * E/P) while router_logits
    (and replayed ids) cover all E; every rank of the group calls together (forward and backward).
    Outputs and every gradient have the bits of the single-rank layer over the ranks' tokens one rank
    after another (mok/distributed.py). Eager only (not under torch.compile or CUDA graphs).
    First-order gradients only: a backward with create_graph=True (double backward) raises
    mok.UnsupportedError.
    """
    _check_experts(hidden_states_TH, w13_E2IH, w2_EHI)
    check_router_logits(router_logits_TE, top_k)
    num_tokens = hidden_states_TH.shape[0]
    num_experts = w13_E2IH.shape[0]
    if ep_group is not None:
        num_experts = _expert_parallel_experts(router_logits_TE, num_experts, ep_group)
    if tuple(router_logits_TE.shape) != (num_tokens, num_experts) or router_logits_TE.device != hidden_states_TH.device:
        raise UnsupportedError(f"router_logits must be [{num_tokens}, {num_experts}] on {hidden_states_TH.device}, "
                               f"got {tuple(router_logits_TE.shape)} on {router_logits_TE.device}")
    renormalize = check_bool(renormalize, "moe: renormalize")
    check_name(name, "moe")
    if name is not None and hooks.observed():
        hooks.emit(name, hidden_states_TH, "input")

    ids_TK = given_weights_TK = None
    if topk_ids is None:
        if topk_weights is not None:
            raise UnsupportedError("topk_weights needs topk_ids (routing replay passes both, or topk_ids alone)")
    else:
        check_topk_ids(topk_ids, num_tokens, top_k, num_experts, hidden_states_TH.device)
        ids_TK = topk_ids.contiguous()
        if topk_weights is not None:
            if not isinstance(topk_weights, torch.Tensor) or not topk_weights.is_floating_point():
                raise UnsupportedError("topk_weights must be a float tensor")
            check_tensor(topk_weights, "topk_weights")
            if tuple(topk_weights.shape) != (num_tokens, top_k) or topk_weights.device != hidden_states_TH.device:
                raise UnsupportedError(f"topk_weights must be [{num_tokens}, {top_k}] on {hidden_states_TH.device}, "
                                       f"got {tuple(topk_weights.shape)} on {topk_weights.device}")
            given_weights_TK = topk_weights.float().contiguous()

    # The weights depend on the logits unless they are given; a gradient is needed when any input of the
    # experts requires one (the save decision of _experts_op).
    weights_source = router_logits_TE if given_weights_TK is None else given_weights_TK
    if ep_group is not None:
        out_TH = _moe_expert_parallel(hidden_states_TH, router_logits_TE, w13_E2IH, w2_EHI, ids_TK, given_weights_TK,
                                      top_k, renormalize, ep_group, weights_source)
    elif not (torch.is_grad_enabled()
              and any(t.requires_grad for t in (hidden_states_TH, w13_E2IH, w2_EHI, weights_source))):
        out_TH = _infer(hidden_states_TH.contiguous(), router_logits_TE.contiguous(), w13_E2IH, w2_EHI, ids_TK,
                           given_weights_TK, top_k, renormalize)
    else:
        ids_TK, weights_TK = _routes(router_logits_TE, ids_TK, given_weights_TK, top_k, renormalize)
        out_TH = _experts(hidden_states_TH.contiguous(), w13_E2IH, w2_EHI, ids_TK, weights_TK, True)[0]
    if name is not None and hooks.observed():
        hooks.emit(name, out_TH, "output")
    return out_TH


def _routes(router_logits_TE, ids_TK, given_weights_TK, top_k, renormalize) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids [T, K], topk_weights [T, K]): routed (no ids), replayed (ids, weights from the logits) or given."""
    if ids_TK is None:
        ids_TK, weights_TK, _ = _route(router_logits_TE.contiguous(), top_k, renormalize)
    elif given_weights_TK is None:
        weights_TK, _ = _replay(router_logits_TE.contiguous(), ids_TK, renormalize)
    else:
        weights_TK = given_weights_TK
    return ids_TK, weights_TK


def _expert_parallel_experts(router_logits_TE: torch.Tensor, local_experts: int, ep_group) -> int:
    """All E experts of an expert-parallel layer (w13 holds local_experts = E/P of them); the logits must cover E."""
    from mok import distributed

    ep_size, _ = distributed.group_size_rank(ep_group)
    if router_logits_TE.shape[1] != local_experts * ep_size:
        raise UnsupportedError(f"router_logits have {router_logits_TE.shape[1]} experts, but w13 holds {local_experts} "
                               f"per rank x {ep_size} ranks of ep_group = {local_experts * ep_size}")
    return local_experts * ep_size


def _moe_expert_parallel(hidden_TH, router_logits_TE, w13_E2IH, w2_EHI, ids_TK, given_weights_TK, top_k, renormalize,
                         ep_group, weights_source) -> torch.Tensor:
    """mok.moe over an expert-parallel group: the same routing ops, then mok/distributed.py's experts."""
    from mok import distributed

    ids_TK, weights_TK = _routes(router_logits_TE, ids_TK, given_weights_TK, top_k, renormalize)
    save = torch.is_grad_enabled() and any(t.requires_grad for t in (hidden_TH, w13_E2IH, w2_EHI, weights_source))
    return distributed.experts(hidden_TH.contiguous(), w13_E2IH, w2_EHI, ids_TK, weights_TK, ep_group, save)
