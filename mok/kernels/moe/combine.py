"""The combine of the MoE layer (the weighted sum over a token's K slots) and its backward.

Shapes: docs/shapes.md. The K contributions of a token are summed in order k = 0..K-1 in fp32 by one program,
and in the backward each slot is read and written by exactly one program: no atomics (docs/kernels.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok.kernels.launch import cached_launch, pdl_options, wait_for_predecessor
from mok.kernels.moe import configs


@cached_launch
@triton.jit
def _combine_kernel(y_ptr, weights_ptr, ids_ptr, out_ptr, hidden, num_experts, stride_yn, stride_ot,
                    TOP_K: tl.constexpr, HAS_WEIGHTS: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """out[t] = round(sum_{k=0..K-1} weight[t, k] * y[t * K + k]) in fp32, k in order.

    With weights, a token with any id (ids [T, K]) outside [0, num_experts) takes NaN weights, so its
    row is NaN (the schedule ran it on experts 0..K-1; docs/contracts.md, "Routing").
    Without weights: the plain sum (used for d hidden). One program per (token, column block).
    PDL: launched with programmatic dependent launch (mok/kernels/launch.py).
    """
    wait_for_predecessor(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    if HAS_WEIGHTS:
        invalid = tl.zeros([], dtype=tl.int32)
        for k in tl.static_range(TOP_K):
            expert = tl.load(ids_ptr + token * TOP_K + k)
            invalid += ((expert < 0) | (expert >= num_experts)).to(tl.int32)
    for k in tl.static_range(TOP_K):
        y = tl.load(y_ptr + (token * TOP_K + k) * stride_yn + offs_h, mask=mask_h, other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            weight = tl.load(weights_ptr + token * TOP_K + k)
            acc = acc + tl.where(invalid > 0, float("nan"), weight) * y
        else:
            acc = acc + y
    tl.store(out_ptr + token * stride_ot + offs_h, acc.to(out_ptr.dtype.element_ty), mask=mask_h)


@cached_launch
@triton.jit
def _combine_backward_kernel(grad_out_ptr, y_ptr, weights_ptr, grad_y_ptr, grad_weights_ptr, row_of_slot_ptr, hidden,
                             num_slots, stride_gt, stride_yn, stride_gyn, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
                             SLOTS: tl.constexpr, ROW_MAP: tl.constexpr):
    """Per slot s = t * K + k: d weight[t, k] = <d out[t], y[s]> (fp32, column blocks in order) and
    d y[s] = round(weight[t, k] * d out[t]), stored at row s or, with ROW_MAP, at row row_of_slot[s] (its
    schedule position: d y in schedule order; same values). SLOTS consecutive slots per program, each computed
    alone: any SLOTS gives the same bits."""
    for i in tl.static_range(SLOTS):
        slot = tl.program_id(0).to(tl.int64) * SLOTS + i
        if slot < num_slots:
            token = slot // TOP_K
            if ROW_MAP:
                grad_row = tl.load(row_of_slot_ptr + slot).to(tl.int64)
            else:
                grad_row = slot
            weight = tl.load(weights_ptr + slot)
            dot = tl.zeros([], dtype=tl.float32)
            for h0 in range(0, hidden, BLOCK_H):
                offs_h = h0 + tl.arange(0, BLOCK_H)
                mask_h = offs_h < hidden
                grad = tl.load(grad_out_ptr + token * stride_gt + offs_h, mask=mask_h, other=0.0).to(tl.float32)
                y = tl.load(y_ptr + slot * stride_yn + offs_h, mask=mask_h, other=0.0).to(tl.float32)
                dot = dot + tl.sum(grad * y, axis=0)
                tl.store(grad_y_ptr + grad_row * stride_gyn + offs_h,
                         (weight * grad).to(grad_y_ptr.dtype.element_ty), mask=mask_h)
            tl.store(grad_weights_ptr + slot, dot)


def launch_combine(y_NH: torch.Tensor, weights_TK: torch.Tensor | None, out_TH: torch.Tensor, top_k: int,
                   ids_TK: torch.Tensor | None = None, num_experts: int = 0) -> torch.Tensor:
    """out_TH[t] = sum over k in order of weights_TK[t, k] * y_NH[t * K + k] (the plain sum without weights).

    With weights, ids_TK (contiguous int [T, K]) and num_experts are needed: a token with an id outside
    [0, num_experts) gets NaN weights."""
    num_tokens, hidden = out_TH.shape
    if num_tokens == 0:
        return out_TH
    has_weights = weights_TK is not None
    if has_weights and ids_TK is None:
        raise ValueError("launch_combine: weights need the ids they belong to")
    block_h = min(configs.COMBINE_BLOCK_H, triton.next_power_of_2(hidden))
    grid = (num_tokens, triton.cdiv(hidden, block_h))
    _combine_kernel[grid](
        y_NH, weights_TK if has_weights else y_NH, ids_TK if has_weights else y_NH, out_TH, hidden, num_experts,
        y_NH.stride(0), out_TH.stride(0), TOP_K=top_k, HAS_WEIGHTS=has_weights, BLOCK_H=block_h, num_warps=4,
        **pdl_options(out_TH.device))
    return out_TH


def launch_combine_backward(grad_out_TH: torch.Tensor, y_NH: torch.Tensor, weights_TK: torch.Tensor, top_k: int,
                            row_of_slot_N: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (d y [N, H] in slot order, or in schedule order when row_of_slot_N (int32 [N]) is given;
    d topk_weights fp32 [T, K])."""
    num_tokens, hidden = grad_out_TH.shape
    grad_y_NH = torch.empty_like(y_NH)
    grad_weights_TK = torch.empty(num_tokens, top_k, device=y_NH.device, dtype=torch.float32)
    if num_tokens:
        block_h = min(configs.COMBINE_BLOCK_H, triton.next_power_of_2(hidden))
        row_map = row_of_slot_N is not None
        num_slots, slots = num_tokens * top_k, configs.COMBINE_BACKWARD_SLOTS or top_k
        _combine_backward_kernel[(triton.cdiv(num_slots, slots),)](
            grad_out_TH, y_NH, weights_TK, grad_y_NH, grad_weights_TK, row_of_slot_N if row_map else weights_TK,
            hidden, num_slots, grad_out_TH.stride(0), y_NH.stride(0), grad_y_NH.stride(0), TOP_K=top_k,
            BLOCK_H=block_h, SLOTS=slots, ROW_MAP=row_map, num_warps=4)
    return grad_y_NH, grad_weights_TK
