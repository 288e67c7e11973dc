"""The MoE layer's pieces on the Triton kernels, as the expert-parallel path (mok/distributed.py) runs them.

Expert parallelism splits the layer in two places: the experts run on the rank that holds them, over the
rows other ranks sent (one row per routed slot, so K = 1 there), and the weighted combine runs on the
token's home rank. These adapters are the same launches `layer.moe_forward` / `layer.moe_backward` make,
cut at those two places; the CPU reference has the same pieces (mok/reference/moe.py: experts_forward,
combine, combine_backward, experts_backward, sum_slots).

Why the bits do not change with the cut: a row's bits depend only on its own inputs and expert (the K
loops are sequential; docs/kernels.md), the combine sums k = 0..K-1 in fp32 in order on the home rank,
and an expert's weight gradient reduces over its rows in schedule order, which the caller makes equal to
the single-rank order (rows arrive by source rank, then slot).

Shapes: docs/shapes.md; M = rows an expert rank received (one per slot routed to it).
"""
from __future__ import annotations

import torch

from mok.kernels.moe.combine import launch_combine, launch_combine_backward
from mok.kernels.moe.configs import pick_configs
from mok.kernels.moe.grouped_gemm import launch_gemm1, launch_gemm2
from mok.kernels.moe.layer import BackwardStages
from mok.kernels.moe.schedule import Schedule


def experts_forward(x_MH: torch.Tensor, w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor, ids_M1: torch.Tensor,
                    save_for_backward: bool) -> tuple[torch.Tensor, ...]:
    """The experts of M rows, one slot each: (y [M, H] in x's dtype, then for the backward gate_up [M, 2I],
    act [M, I] (schedule order), sorted_slots int64 [M], expert_start int64 [E + 1]; empty without
    save_for_backward). x_MH [M, H]; ids_M1 int32 [M, 1]: each row's (local) expert."""
    num_rows, hidden = x_MH.shape
    num_experts, two_inter, _ = w13_E2IH.shape
    device, dtype = x_MH.device, x_MH.dtype
    y_MH = torch.empty(num_rows, hidden, device=device, dtype=dtype)
    cfg = pick_configs(num_rows, num_experts, hidden=hidden)
    schedule = Schedule(ids_M1.contiguous(), num_experts, block_m=cfg["gemm1"]["BLOCK_M"])
    if num_rows:
        gate_up_M2I, act_MI = launch_gemm1(x_MH.contiguous(), w13_E2IH, schedule, 1, save_for_backward, cfg["gemm1"])
        launch_gemm2(act_MI, w2_EHI, y_MH, schedule, 1, cfg["gemm2"])
    else:
        gate_up_M2I = torch.empty(0, two_inter, device=device, dtype=dtype)
        act_MI = torch.empty(0, two_inter // 2, device=device, dtype=dtype)
    if not save_for_backward:
        return (y_MH,)
    return y_MH, gate_up_M2I, act_MI, schedule.sorted_slots_N.long(), schedule.expert_start.long()


def experts_backward(grad_y_MH: torch.Tensor, x_MH: torch.Tensor, w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor,
                     ids_M1: torch.Tensor, y_MH: torch.Tensor, gate_up_M2I: torch.Tensor, act_MI: torch.Tensor,
                     sorted_slots_M: torch.Tensor, expert_start: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d x per row fp32 [M, H] (not rounded: the home rank sums a token's K rows first), d w13, d w2).

    grad_y_MH: [M, H] in x's dtype (d y = round(weight * d out), made on the home rank). The stages of
    layer.BackwardStages with K = 1 and weights 1: its combine backward copies d y exactly (1 * g in
    fp32, rounded back to the dtype g already has), and its last stage (the sum over k) is left out."""
    num_rows = x_MH.shape[0]
    ones_M1 = torch.ones(num_rows, 1, device=x_MH.device, dtype=torch.float32)
    stages = BackwardStages(grad_y_MH, x_MH, w13_E2IH, w2_EHI, ids_M1.contiguous(), ones_M1, gate_up_M2I, act_MI,
                            y_MH, sorted_slots_M, expert_start)
    for name, run in stages.stages:
        if name != "combine_dx":
            run()
    grad_x_MH = stages.grad_hidden_NH
    if grad_x_MH is None:  # no rows
        grad_x_MH = torch.empty(0, x_MH.shape[1], device=x_MH.device, dtype=torch.float32)
    return grad_x_MH, stages.grad_w13_E2IH, stages.grad_w2_EHI


def combine(y_NH: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """out [T, H] = the fixed-order fp32 combine of y [N, H] (slot order) with weights fp32 [T, K]; a token
    with an id outside [0, num_experts) gets a NaN row (as in layer.moe_forward)."""
    num_tokens, top_k = weights_TK.shape
    out_TH = torch.empty(num_tokens, y_NH.shape[1], device=y_NH.device, dtype=y_NH.dtype)
    return launch_combine(y_NH, weights_TK.float().contiguous(), out_TH, top_k, ids_TK.contiguous(), num_experts)


def combine_backward(grad_out_TH: torch.Tensor, y_NH: torch.Tensor, weights_TK: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(d y [N, H] in y's dtype, slot order; d weights fp32 [T, K]); d out is rounded to y's dtype first."""
    return launch_combine_backward(grad_out_TH.to(y_NH.dtype).contiguous(), y_NH, weights_TK.float().contiguous(),
                                   weights_TK.shape[1])


def sum_slots(grad_x_NH: torch.Tensor, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, H] in dtype: the fp32 rows [N, H] of each token summed over k = 0..K-1 in order, rounded once."""
    num_tokens = grad_x_NH.shape[0] // top_k
    out_TH = torch.empty(num_tokens, grad_x_NH.shape[1], device=grad_x_NH.device, dtype=dtype)
    return launch_combine(grad_x_NH, None, out_TH, top_k)
