"""Expert parallelism for mok.moe: the same bits at every expert-parallel size.

`mok.moe(..., ep_group=group)` with a process group of P ranks: rank r holds the contiguous block of E/P
experts [r * E/P, (r + 1) * E/P) in its w13 [E/P, 2I, H] and w2 [E/P, H, I], passes its own tokens and
their router logits over all E experts, and gets its tokens' outputs. Every rank of the group must call
it together (forward and backward: both exchange rows with every other rank).

The data path (one rank's view; routing is mok.route on the rank's own logits, as at P = 1):
  dispatch  each routed slot (t, k) becomes one row for the rank holding expert ids[t, k]; rows go out
            grouped by destination rank, in slot order inside a destination; the counts go first
            (all_to_all_single), then the rows and their local expert ids (all_to_all_single).
  experts   the received rows, by source rank then slot, run through the same experts code as P = 1
            (K = 1 per row: mok/reference/moe.py experts_forward on the CPU, mok/kernels/moe/
            expert_parallel.py on CUDA); the outputs y go back the same way (all_to_all_single).
  combine   on the token's home rank, with the same combine as P = 1: sum over k = 0..K-1 in fp32 of
            weight[t, k] * y[t, k], rounded once.
Backward, through the same exchanges in reverse: d y = round(weight * d out) and d weights on the home
rank; d y rows travel to the expert ranks, which return each row's d x in fp32 (not rounded) and keep
the weight gradients of their experts; the home rank sums a token's K rows of d x in order k = 0..K-1,
rounded once, as at P = 1.

Why the bits equal P = 1's for the same tokens (the batch at P = 1 being the ranks' tokens one rank
after another): (a) every expert row is computed by batch-invariant code, whatever else the expert
gets; (b) the combine and the d x sum run on the home rank in the P = 1 order; (c) an expert's weight
gradient reduces over its rows in schedule order, and its rows arrive by source rank, then by slot
(token, k): exactly the global slot order that P = 1's schedule uses (stable by token, then k).
tests/distributed/ proves it bitwise for outputs, d hidden, d router logits, d w13 and d w2.

Transport: rows travel as raw bytes (a uint8 view), so no backend converts a value, and a dtype the
backend lacks (bf16 on some gloo builds) still travels. The counts need one host synchronisation per
layer (the split sizes); this path runs eagerly, not under torch.compile or CUDA graphs.

Shapes: docs/shapes.md; M: rows a rank receives (one per slot routed to one of its experts).
"""
from __future__ import annotations

import types

import torch
import torch.distributed as dist

from mok.errors import UnsupportedError


def group_size_rank(group) -> tuple[int, int]:
    """(size, this process's rank in it) of an expert-parallel process group; UnsupportedError otherwise."""
    if not dist.is_available() or not dist.is_initialized():
        raise UnsupportedError("ep_group needs torch.distributed initialised (init_process_group)")
    if not isinstance(group, dist.ProcessGroup):
        raise UnsupportedError(f"ep_group must be a torch.distributed.ProcessGroup, got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise UnsupportedError("ep_group does not contain this process")
    return dist.get_world_size(group), rank


def local_experts(num_experts: int, group) -> range:
    """The experts this rank holds: the contiguous block [r * E/P, (r + 1) * E/P) for rank r of P.

    UnsupportedError when E is not divisible by P."""
    size, rank = group_size_rank(group)
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise UnsupportedError(f"num_experts must be an int >= 1, got {num_experts!r}")
    if num_experts % size:
        raise UnsupportedError(f"{num_experts} experts are not divisible by the expert-parallel size {size}")
    per_rank = num_experts // size
    return range(rank * per_rank, (rank + 1) * per_rank)


# ---------------------------------------------------------------------------------------------
# the layer's pieces per device: the CPU reference, or the Triton kernels (the same cut)


def _reference_pieces():
    from mok.reference import moe as reference

    def experts_forward(x_MH, w13_E2IH, w2_EHI, ids_M1, save_for_backward):
        gate_up_M2I, act_MI, y_MH, sorted_slots_M, expert_start = reference.experts_forward(
            x_MH, w13_E2IH, w2_EHI, ids_M1)
        return (y_MH, gate_up_M2I, act_MI, sorted_slots_M, expert_start) if save_for_backward else (y_MH,)

    def experts_backward(grad_y_MH, x_MH, w13_E2IH, w2_EHI, ids_M1, y_MH, gate_up_M2I, act_MI, sorted_slots_M,
                         expert_start):
        return reference.experts_backward(grad_y_MH, x_MH, w13_E2IH, w2_EHI, 1, gate_up_M2I, act_MI,
                                          sorted_slots_M, expert_start)

    def combine(y_NH, weights_TK, ids_TK, num_experts):
        return reference.combine(y_NH, weights_TK, weights_TK.shape[1])

    return types.SimpleNamespace(experts_forward=experts_forward, experts_backward=experts_backward, combine=combine,
                                 combine_backward=reference.combine_backward, sum_slots=reference.sum_slots)


_KERNELS_ON_CPU = False  # tests: the Triton pieces on CPU tensors, under TRITON_INTERPRET=1


def _pieces(device: torch.device):
    if device.type == "cuda" or _KERNELS_ON_CPU:
        from mok.kernels.moe import expert_parallel

        return expert_parallel
    return _reference_pieces()


# ---------------------------------------------------------------------------------------------
# dispatch plan and the exchange


def _exchange(t: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    """all_to_all_single of the rows of t [rows, ...]: send_splits[p] rows (in order) to rank p, recv_splits[p]
    rows from rank p, as raw bytes."""
    row_shape = tuple(t.shape[1:])
    row_numel = 1
    for size in row_shape:
        row_numel *= size
    send = t.contiguous().reshape(t.shape[0], row_numel).view(torch.uint8)
    recv = torch.empty(sum(recv_splits), send.shape[1], device=t.device, dtype=torch.uint8)
    dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
    return recv.view(t.dtype).reshape(recv.shape[0], *row_shape)


class _Plan:
    """Where each routed slot goes: rows grouped by destination rank, slot order inside a destination.

    slot_of_row_N int64 [N]: the slot (t * K + k) of each outgoing row; row_of_slot_N: its inverse;
    local_ids_N int32 [N]: each outgoing row's expert on its destination; send_splits / recv_splits: rows
    to / from each rank (host ints, exchanged with the group)."""

    def __init__(self, ids_TK: torch.Tensor, num_experts: int, group, size: int):
        device = ids_TK.device
        top_k = ids_TK.shape[1]
        per_rank = num_experts // size
        # Replayed ids outside [0, E) (CUDA checks none on the host) run on experts 0..K-1, as at P = 1
        # (the combine gives that token NaN weights): docs/contracts.md, "Routing".
        invalid_T1 = ((ids_TK < 0) | (ids_TK >= num_experts)).any(dim=-1, keepdim=True)
        ids_N = torch.where(invalid_T1, torch.arange(top_k, device=device), ids_TK.long()).reshape(-1)
        dest_N = ids_N // per_rank
        sorted_dest_N, self.slot_of_row_N = torch.sort(dest_N, stable=True)
        num_slots = ids_N.shape[0]
        self.row_of_slot_N = torch.empty(num_slots, device=device, dtype=torch.int64)
        self.row_of_slot_N[self.slot_of_row_N] = torch.arange(num_slots, device=device)  # distinct indices
        self.local_ids_N = (ids_N - dest_N * per_rank).index_select(0, self.slot_of_row_N).to(torch.int32)
        bounds = torch.searchsorted(sorted_dest_N, torch.arange(size + 1, device=device))
        send_counts = (bounds[1:] - bounds[:-1]).contiguous()
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        self.send_splits = send_counts.tolist()
        self.recv_splits = recv_counts.tolist()
        self.top_k = top_k


class _ExpertParallelMoE(torch.autograd.Function):
    """(hidden [T, H], w13 [E/P, 2I, H], w2 [E/P, H, I], weights fp32 [T, K]; ids int [T, K]) -> out [T, H]."""

    @staticmethod
    def forward(ctx, hidden_TH, w13_E2IH, w2_EHI, weights_TK, ids_TK, num_experts, group, size, save_for_backward):
        pieces = _pieces(hidden_TH.device)
        plan = _Plan(ids_TK, num_experts, group, size)
        x_send_NH = hidden_TH.index_select(0, plan.slot_of_row_N // plan.top_k)
        x_MH = _exchange(x_send_NH, plan.send_splits, plan.recv_splits, group)
        ids_M = _exchange(plan.local_ids_N, plan.send_splits, plan.recv_splits, group)
        ids_M1 = ids_M[:, None]
        expert = pieces.experts_forward(x_MH, w13_E2IH, w2_EHI, ids_M1, save_for_backward)
        y_back_NH = _exchange(expert[0], plan.recv_splits, plan.send_splits, group)
        y_NH = y_back_NH.index_select(0, plan.row_of_slot_N)
        out_TH = pieces.combine(y_NH, weights_TK, ids_TK, num_experts)
        ctx.plan, ctx.group, ctx.saved = plan, group, save_for_backward
        ctx.weights_dtype, ctx.hidden_dtype = weights_TK.dtype, hidden_TH.dtype
        if save_for_backward:
            ctx.save_for_backward(w13_E2IH, w2_EHI, weights_TK, y_NH, x_MH, ids_M1, *expert)
        return out_TH

    @staticmethod
    def backward(ctx, grad_out_TH):
        if not ctx.saved:
            raise UnsupportedError("mok.moe: backward through a forward that ran without grad mode (nothing was saved)")
        plan, group = ctx.plan, ctx.group
        w13_E2IH, w2_EHI, weights_TK, y_NH, x_MH, ids_M1, *expert = ctx.saved_tensors
        pieces = _pieces(y_NH.device)
        grad_y_NH, grad_weights_TK = pieces.combine_backward(grad_out_TH, y_NH, weights_TK)
        grad_y_MH = _exchange(grad_y_NH.index_select(0, plan.slot_of_row_N), plan.send_splits, plan.recv_splits,
                              group)
        grad_x_MH, grad_w13_E2IH, grad_w2_EHI = pieces.experts_backward(grad_y_MH, x_MH, w13_E2IH, w2_EHI, ids_M1,
                                                                        *expert)
        grad_x_back_NH = _exchange(grad_x_MH, plan.recv_splits, plan.send_splits, group)
        grad_x_NH = grad_x_back_NH.index_select(0, plan.row_of_slot_N)
        grad_hidden_TH = pieces.sum_slots(grad_x_NH, plan.top_k, ctx.hidden_dtype)
        return (grad_hidden_TH, grad_w13_E2IH, grad_w2_EHI, grad_weights_TK.to(ctx.weights_dtype),
                None, None, None, None, None)


def experts(hidden_TH: torch.Tensor, w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor, ids_TK: torch.Tensor,
            weights_TK: torch.Tensor, group, save_for_backward: bool) -> torch.Tensor:
    """The expert part of mok.moe over an expert-parallel group (mok.moe validates and routes first).

    hidden_TH [T, H]; w13_E2IH [E/P, 2I, H] and w2_EHI [E/P, H, I]: this rank's experts; ids_TK int
    [T, K] over all E = P * E/P experts; weights_TK fp32 [T, K]. Returns [T, H] in hidden's dtype,
    differentiable w.r.t. hidden, w13, w2 and weights (gradients flow back through the exchanges).
    """
    size, _ = group_size_rank(group)
    num_experts = w13_E2IH.shape[0] * size
    return _ExpertParallelMoE.apply(hidden_TH, w13_E2IH, w2_EHI, weights_TK, ids_TK, num_experts, group, size,
                                    save_for_backward)
