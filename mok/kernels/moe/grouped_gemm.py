"""The grouped GEMMs of the MoE layer: GEMM 1 + SwiGLU, the grouped GEMM of GEMM 2 and the backward
(d act with the SwiGLU backward, d hidden), the weight gradients, and their launchers.

Shapes: docs/shapes.md. Kernel rules (sequential unsplit K loop, fp32 accumulator, no TF32, no float
atomics, tile-shape invariance measured on the H200): docs/kernels.md. Every GEMM walks its reduction
dimension in one sequential loop of BLOCK_K steps with an fp32 accumulator, so a row's bits do not
depend on BLOCK_M/BLOCK_N/BLOCK_K, warps or stages (tests/mok/test_moe_gpu.py re-proves it per kernel).
Row tiles come from the schedule (schedule.py): a tile holds BLOCK_M consecutive schedule positions
of one expert. TMA descriptors (configs with TMA=1) only change how tiles are loaded: same tiles,
same values, same order, same bits.

This module holds the launchers; the kernels live by role: gemm1.py (GEMM 1 + SwiGLU), gemm2.py (the grouped GEMM:
GEMM 2, d act, d hidden), weight_grad.py (d w13, d w2), and gemm_tiles.py what they share.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok.kernels.launch import INTERPRET, pdl_options
from mok.kernels.moe.configs import split_config
from mok.kernels.moe.gemm1 import _gemm1_swiglu_kernel, _route_tokens  # noqa: F401  (_route_tokens: GEMM 1's ROUTE)
from mok.kernels.moe.gemm2 import TMA_B_KN, TMA_B_NK, TMA_B_OFF, _grouped_gemm_kernel
from mok.kernels.moe.gemm_tiles import ROWS_POSITION, ROWS_SLOT, ROWS_TOKEN
from mok.kernels.moe.routing import route_blocks
from mok.kernels.moe.schedule import ScannedRoutes, Schedule
from mok.kernels.moe.weight_grad import _weight_grad_kernel

try:  # host-side TMA descriptors (Triton >= 3.4); without them every kernel uses pointer loads
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None


def _tma_ok(t: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned base and row strides; 16-bit dtypes only (fp32 stays on pointers)."""
    return (TensorDescriptor is not None and t.dtype in (torch.bfloat16, torch.float16) and t.is_contiguous()
            and t.numel() > 0 and t.data_ptr() % 16 == 0
            and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1]))


def _descriptor(t2d: torch.Tensor, block_shape: list[int]):
    rows, cols = t2d.shape
    return TensorDescriptor(t2d, [rows, cols], [cols, 1], block_shape)


def launch_gemm1(x_TH: torch.Tensor, w13_E2IH: torch.Tensor, schedule: Schedule | ScannedRoutes, top_k: int,
                 save_gate_up: bool, config: dict, act_NI: torch.Tensor | None = None,
                 route: tuple[torch.Tensor, torch.Tensor, bool] | None = None
                 ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """-> (gate_up_N2I, act_NI), rows in schedule order (slot order with ScannedRoutes); gate_up_N2I has no
    rows unless save_gate_up.
    act_NI: a contiguous [N, I] buffer to write instead of a fresh one; then without save_gate_up no
    gate_up tensor is made (None comes back).
    route (with ScannedRoutes): (logits fp32 [T, E] contiguous, weights fp32 [T, K] contiguous, renormalize): GEMM 1
    routes the tokens itself (the kernel's ROUTE) and writes their ids into the ScannedRoutes' ids (int32 [T, K])
    and their weights into `weights`, the routing kernel's values, for GEMM 2 and the combine."""
    num_slots = schedule.num_slots
    num_experts, two_inter, hidden = w13_E2IH.shape
    inter = two_inter // 2
    if act_NI is None:
        act_NI = torch.empty(num_slots, inter, device=x_TH.device, dtype=x_TH.dtype)
        gate_up_N2I = torch.empty(num_slots if save_gate_up else 0, 2 * inter, device=x_TH.device, dtype=x_TH.dtype)
    else:
        gate_up_N2I = (torch.empty(num_slots, 2 * inter, device=x_TH.device, dtype=x_TH.dtype) if save_gate_up
                       else None)
    block_m, block_n, block_k, group_m, tma, cfg = split_config(config)
    tma_b = tma and _tma_ok(w13_E2IH)
    w13_desc = _descriptor(w13_E2IH.view(num_experts * two_inter, hidden), [block_n, block_k]) if tma_b else w13_E2IH
    row_programs, row_source, scan = schedule.gemm_rows(block_m)
    if route is not None:
        if not scan["SCANNED"] or schedule.ids_N.dtype != torch.int32:
            raise ValueError("launch_gemm1: routing inside GEMM 1 needs ScannedRoutes over an int32 ids buffer")
        logits_TE, weights_TK, renormalize = route
        routing = dict(ROUTE=True, RENORMALIZE=renormalize, BLOCK_E=route_blocks(num_experts, top_k)["BLOCK_E"])
    else:
        logits_TE = weights_TK = x_TH  # unread
        routing = dict(ROUTE=False, RENORMALIZE=False, BLOCK_E=1)
    grid = (row_programs * triton.cdiv(inter, block_n),)
    _gemm1_swiglu_kernel[grid](
        x_TH, w13_E2IH, w13_desc, gate_up_N2I if save_gate_up else act_NI, act_NI, logits_TE, weights_TK,
        *row_source, inter, hidden,
        x_TH.stride(0), x_TH.stride(1), w13_E2IH.stride(0), w13_E2IH.stride(1), w13_E2IH.stride(2),
        logits_TE.stride(0),
        TOP_K=top_k, SAVE_GATE_UP=save_gate_up, UPCAST=INTERPRET,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, TMA_B=tma_b, **scan, **cfg,
        **routing, **pdl_options(x_TH.device, grid[0]))
    return gate_up_N2I, act_NI


def _launch_grouped_gemm(a, b_E, b_strides, c, n_cols, k_dim, schedule: Schedule | ScannedRoutes, top_k: int,
                         config: dict, *, a_rows: tl.constexpr, c_rows: tl.constexpr, gate_up=None):
    """c[rows] = a[rows] @ B[e], B[e][k, n] at b_E + e * stride_e + k * stride_k + n * stride_n.

    a: [N, k_dim] rows addressed as a_rows says; c: [N, n_cols] (with gate_up: [N, 2 * n_cols]) rows
    addressed as c_rows says; b_E a weight tensor [E, ., .]. With gate_up ([N, 2 * n_cols], schedule
    order) given, c is d gate_up and the kernel runs the SwiGLU backward epilogue. With TMA in the
    config, B tiles come through a descriptor when B[e] is b_E[e] ([k_dim, n_cols], needs BLOCK_K |
    k_dim) or its transpose ([n_cols, k_dim]), and A tiles when a is in schedule order.
    """
    block_m, block_n, block_k, group_m, tma, cfg = split_config(config)
    prefetch_k = cfg.pop("PREFETCH_K", 0)
    lean_epilogue = cfg.pop("LEAN_EPILOGUE", 0)
    if block_n % 2:
        lean_epilogue = 0  # the SwiGLU backward's column halves need an even BLOCK_N
    if lean_epilogue == 1 and (c.stride(0) * c.shape[0] >= 2**31 or (gate_up is not None and gate_up.numel() >= 2**31)):
        lean_epilogue = 2  # int32 offsets would not reach every element of c (or of gate_up): int64 row bases
    row_programs, row_source, scan = schedule.gemm_rows(block_m)
    stride_e, stride_k, stride_n = b_strides
    grid = (row_programs * triton.cdiv(n_cols, block_n),)
    launch = pdl_options(c.device, grid[0])
    line = 128 // b_E.element_size()
    # The prefetch guesses its tile before the wait: only with PDL, only from scanned ids (valid_ids bounds any id
    # read early; a schedule's tiles may be half written by the launch just before and are not range-checked),
    # and one prefetch per line needs k contiguous.
    prefetches = prefetch_k and launch["PDL"] and scan["SCANNED"] and stride_k == 1
    prefetch_k = triton.next_power_of_2(max(prefetch_k, line)) if prefetches else 0
    # a scanned tile's rows are slots, not consecutive positions: no A descriptor
    tma_a = (tma and bool(a_rows == ROWS_POSITION) and not scan["SCANNED"] and _tma_ok(a)
             and a.shape[1] == k_dim)
    a_desc = _descriptor(a, [block_m, block_k]) if tma_a else a
    tma_b, b_desc = TMA_B_OFF, b_E
    if tma and b_E.dim() == 3 and _tma_ok(b_E):
        num_experts, rows, cols = b_E.shape
        flat = b_E.view(num_experts * rows, cols)
        if stride_k == 1 and (rows, cols) == (n_cols, k_dim):
            tma_b, b_desc = TMA_B_NK, _descriptor(flat, [block_n, block_k])
        elif stride_n == 1 and (rows, cols) == (k_dim, n_cols) and k_dim % block_k == 0:
            tma_b, b_desc = TMA_B_KN, _descriptor(flat, [block_k, block_n])
    _grouped_gemm_kernel[grid](
        a, a_desc, b_E, b_desc, c, gate_up if gate_up is not None else c,
        *row_source, n_cols, k_dim,
        a.stride(0), a.stride(1), stride_e, stride_k, stride_n, c.stride(0), c.stride(1),
        A_ROWS=a_rows, C_ROWS=c_rows, SWIGLU_BACKWARD=gate_up is not None,
        LEAN_EPILOGUE=lean_epilogue, TOP_K=top_k, UPCAST=INTERPRET,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, TMA_A=tma_a, TMA_B=tma_b, **scan, **cfg,
        PREFETCH_K=prefetch_k, LINE=line, **launch)


def launch_gemm2(act_NI: torch.Tensor, w2_EHI: torch.Tensor, y_NH: torch.Tensor,
                 schedule: Schedule | ScannedRoutes, top_k: int, config: dict) -> None:
    """GEMM 2: y[slot] = act[p] @ w2[e]^T (act in schedule order, y in slot order): B[e][k=i, n=h] = w2[e, h, i]."""
    _launch_grouped_gemm(act_NI, w2_EHI, (w2_EHI.stride(0), w2_EHI.stride(2), w2_EHI.stride(1)), y_NH,
                         w2_EHI.shape[1], w2_EHI.shape[2], schedule, top_k, config,
                         a_rows=ROWS_POSITION, c_rows=ROWS_SLOT)


def launch_bwd_act(grad_y_NH: torch.Tensor, w2_EHI: torch.Tensor, gate_up_N2I: torch.Tensor,
                   grad_gate_up_N2I: torch.Tensor, schedule: Schedule, top_k: int, config: dict, *,
                   dy_rows: tl.constexpr) -> None:
    """d gate_up[p] = swiglu'(d act[p]), d act[p] = d y[row] @ w2[e]: B[e][k=h, n=i] = w2[e, h, i].

    dy_rows: ROWS_SLOT (d y in slot order) or ROWS_POSITION (d y in schedule order, SORTED_DY)."""
    _launch_grouped_gemm(grad_y_NH, w2_EHI, (w2_EHI.stride(0), w2_EHI.stride(1), w2_EHI.stride(2)), grad_gate_up_N2I,
                         w2_EHI.shape[2], w2_EHI.shape[1], schedule, top_k, config,
                         a_rows=dy_rows, c_rows=ROWS_POSITION, gate_up=gate_up_N2I)


def launch_bwd_dx(grad_gate_up_N2I: torch.Tensor, w13_E2IH: torch.Tensor, grad_hidden_NH: torch.Tensor,
                  schedule: Schedule, top_k: int, config: dict) -> None:
    """d hidden per slot (fp32, slot order) = d gate_up[p] @ w13[e]: B[e][k=j, n=h] = w13[e, j, h]."""
    _launch_grouped_gemm(grad_gate_up_N2I, w13_E2IH, (w13_E2IH.stride(0), w13_E2IH.stride(1), w13_E2IH.stride(2)),
                         grad_hidden_NH, w13_E2IH.shape[2], w13_E2IH.shape[1], schedule, top_k, config,
                         a_rows=ROWS_POSITION, c_rows=ROWS_SLOT)


def _launch_weight_grad(a, b, out, schedule: Schedule, top_k: int, config: dict, *,
                        a_rows: tl.constexpr, b_rows: tl.constexpr) -> None:
    """out[e] = A_e^T @ B_e over expert e's rows, a: [rows, m_dim], b: [rows, n_dim], out: [E, m_dim, n_dim].

    With TMA in the config, an operand addressed by schedule position (ROWS_POSITION) loads its full
    row chunks through a descriptor (contiguous 16-bit tensors with 16-byte aligned rows only).
    """
    num_experts, m_dim, n_dim = out.shape
    block_m, block_n, block_k, _, tma, cfg = split_config(config)
    tma_a = tma and bool(a_rows == ROWS_POSITION) and _tma_ok(a) and a.shape[1] == m_dim
    tma_b = tma and bool(b_rows == ROWS_POSITION) and _tma_ok(b) and b.shape[1] == n_dim
    a_desc = _descriptor(a, [block_k, block_m]) if tma_a else a
    b_desc = _descriptor(b, [block_k, block_n]) if tma_b else b
    grid = (triton.cdiv(m_dim, block_m) * triton.cdiv(n_dim, block_n), num_experts)
    _weight_grad_kernel[grid](
        a, a_desc, b, b_desc, out, schedule.sorted_slots_N, schedule.expert_start,
        m_dim, n_dim, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        A_ROWS=a_rows, B_ROWS=b_rows, TOP_K=top_k, UPCAST=INTERPRET,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, TMA_A=tma_a, TMA_B=tma_b, **cfg)


def launch_weight_grad_w2(grad_y_NH: torch.Tensor, act_NI: torch.Tensor, grad_w2_EHI: torch.Tensor,
                          schedule: Schedule, top_k: int, config: dict, *, dy_rows: tl.constexpr) -> None:
    """d w2[e] = d y_e^T @ act_e over expert e's rows in schedule order (dy_rows: as in launch_bwd_act)."""
    _launch_weight_grad(grad_y_NH, act_NI, grad_w2_EHI, schedule, top_k, config,
                        a_rows=dy_rows, b_rows=ROWS_POSITION)


def launch_weight_grad_w13(grad_gate_up_N2I: torch.Tensor, x_TH: torch.Tensor, grad_w13_E2IH: torch.Tensor,
                           schedule: Schedule, top_k: int, config: dict,
                           x_sorted_NH: torch.Tensor | None = None) -> None:
    """d w13[e] = d gate_up_e^T @ x_e over expert e's rows in schedule order; x rows come from x_TH by
    token, or from x_sorted_NH (x gathered into schedule order, SORTED_X) when given."""
    if x_sorted_NH is not None:
        _launch_weight_grad(grad_gate_up_N2I, x_sorted_NH, grad_w13_E2IH, schedule, top_k, config,
                            a_rows=ROWS_POSITION, b_rows=ROWS_POSITION)
    else:
        _launch_weight_grad(grad_gate_up_N2I, x_TH, grad_w13_E2IH, schedule, top_k, config,
                            a_rows=ROWS_POSITION, b_rows=ROWS_TOKEN)
