"""The MoE layer on the Triton kernels: the adapters mok/ops/routing.py and mok/ops/moe.py call on
CUDA tensors (and the interpreter tests on CPU tensors): route, replay_weights, moe_forward,
moe_backward, moe_infer (routing and experts of a forward that saves nothing, with one workspace
allocation: inference and decode), and BackwardStages (moe_backward as named stages, for bench/moe_sweep.py).

Shapes: docs/shapes.md. Semantics and rounding points: mok/reference/moe.py (the CPU path) — the same
here. The data path: routing.py -> schedule.py -> grouped_gemm.py (GEMM 1 + SwiGLU, GEMM 2) ->
combine.py, and back. Backward: weight gradients reduce over an expert's rows in schedule order in one
program per output tile; d hidden is stored per slot and summed over k in order. The optional layouts
(SORTED_DY, SORTED_X in the configs) only move rows (d y in schedule order, x gathered into schedule
order): same values, same reduction order, same bits.
"""
from __future__ import annotations

import math
import threading

import torch

from mok.kernels import launch
from mok.kernels.moe import configs as moe_configs
from mok.kernels.moe.combine import launch_combine, launch_combine_backward
from mok.kernels.moe.configs import pick_configs
from mok.kernels.moe.grouped_gemm import (
    ROWS_POSITION,
    ROWS_SLOT,
    launch_bwd_act,
    launch_bwd_dx,
    launch_gemm1,
    launch_gemm2,
    launch_weight_grad_w2,
    launch_weight_grad_w13,
)
from mok.kernels.moe.routing import launch_route
from mok.kernels.moe.schedule import ScannedRoutes, Schedule, kernel_buffer_numel, scans_routes


def route(logits_TE: torch.Tensor, top_k: int, renormalize: bool):
    """-> (topk_ids int32 [T, K], topk_weights fp32 [T, K], probs fp32 [T, E])."""
    return launch_route(logits_TE.contiguous(), top_k, renormalize)


def replay_weights(logits_TE: torch.Tensor, ids_TK: torch.Tensor, renormalize: bool):
    """-> (topk_weights fp32 [T, K], probs fp32 [T, E]) for given ids."""
    _, weights_TK, probs_TE = launch_route(logits_TE.contiguous(), ids_TK.shape[1], renormalize, ids_TK.contiguous())
    return weights_TK, probs_TE


def moe_forward(x_TH, w13_E2IH, w2_EHI, ids_TK, weights_TK, save_for_backward: bool, configs: dict | None = None):
    """Expert computation for given routes; same contract as mok.reference.moe.moe_forward.

    Returns (out [T, H], gate_up [N, 2I], act [N, I] (both in schedule order), y [N, H] (slot order),
    sorted_slots int64 [N], expert_start int64 [E + 1]); without save_for_backward the last five are
    empty. `configs` (tests) overrides entries of the chosen config.
    """
    num_tokens, hidden = x_TH.shape
    num_experts, two_inter, _ = w13_E2IH.shape
    top_k = ids_TK.shape[1]
    device, dtype = x_TH.device, x_TH.dtype
    x_TH = x_TH.contiguous()
    weights_TK = weights_TK.float().contiguous()
    cfg = pick_configs(ids_TK.numel(), num_experts, configs, hidden=hidden)
    ids_TK = ids_TK.contiguous()
    # Ids outside [0, E) (replay on CUDA is not range-checked on the host): the schedule runs the token on
    # experts 0..K-1 and the combine gives it NaN weights, on the device (docs/contracts.md, "Routing").
    schedule = Schedule(ids_TK, num_experts, block_m=cfg["gemm1"]["BLOCK_M"])
    out_TH = torch.empty(num_tokens, hidden, device=device, dtype=dtype)
    y_NH = torch.empty(schedule.num_slots, hidden, device=device, dtype=dtype)
    if num_tokens:
        gate_up_N2I, act_NI = launch_gemm1(x_TH, w13_E2IH, schedule, top_k, save_for_backward, cfg["gemm1"])
        launch_gemm2(act_NI, w2_EHI, y_NH, schedule, top_k, cfg["gemm2"])
        launch_combine(y_NH, weights_TK, out_TH, top_k, ids_TK, num_experts)
    else:
        gate_up_N2I = torch.empty(0, two_inter, device=device, dtype=dtype)
        act_NI = torch.empty(0, two_inter // 2, device=device, dtype=dtype)
    if not save_for_backward:
        # Custom-op outputs may not alias each other: one fresh empty tensor each.
        def empty(*shape, dtype=dtype):
            return torch.empty(*shape, device=device, dtype=dtype)

        return (out_TH, empty(0, two_inter), empty(0, two_inter // 2), empty(0, hidden),
                empty(0, dtype=torch.int64), empty(0, dtype=torch.int64))
    return (out_TH, gate_up_N2I, act_NI, y_NH, schedule.sorted_slots_N.long(), schedule.expert_start.long())


_WORKSPACE_ALIGN = 256  # bytes: every piece of moe_infer's workspace starts as aligned as a fresh allocation


def _workspace(device: torch.device, pieces: dict[str, tuple[tuple[int, ...], torch.dtype]]
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One allocation carved into contiguous typed pieces {name: (shape, dtype)}, each 256-byte aligned
    -> (the allocation, {name: piece})."""
    offsets, total = [], 0
    for shape, dtype in pieces.values():
        offsets.append(total)
        total += -(-math.prod(shape) * dtype.itemsize // _WORKSPACE_ALIGN) * _WORKSPACE_ALIGN
    buffer = torch.empty(total, device=device, dtype=torch.uint8)
    return buffer, {name: buffer[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
                    for offset, (name, (shape, dtype)) in zip(offsets, pieces.items())}


# Small calls of moe_infer (decode batches) replayed from launch plans (mok/kernels/launch.py), at most `capacity`
# keys (16; 0: none): the first call of a key records its launches and keeps its workspace; a later call with the
# same key replays them with its own tensors' addresses, the weights' included, so one plan serves every layer of a
# model with these sizes (the layers of a step run in stream order, so they can share its workspace). Why: host
# work, not kernels, is most of an eager decode call (docs/performance.md, "Host time per call"). Only calls whose
# workspace is at most DECODE_PLAN_MAX_BYTES are planned (qwen3-30b-a3b up to T = 93, mixtral-8x7b 56,
# deepseek-v3 28), so the kept workspaces stay under 64 MB. Plans read the module settings they depend on when
# recorded; those in the key (below) are checked at every call; after changing the dicts of configs.py, clear().
# mok.moe's plain eager calls take the native path (mok/kernels/native: decode_site, decode_settings), which keeps
# its own plans under the same capacity, keys and clear().
decode_plans = launch.PlanCache(16)
DECODE_PLAN_MAX_BYTES = 4 << 20


def _decode_plan_key(per_call: tuple, top_k: int, renormalize: bool) -> tuple | None:
    """What fixes a decode call's launches, or None where no plan may be used (plans off, not CUDA, not
    launch.replays_allowed(), or the stream capturing a CUDA graph: the kept workspace would outlive the graph's
    memory pool). The launches follow from the shapes, strides, dtypes and addresses modulo 16 of the
    call's tensors (weights included), top_k, renormalize, PDL and the scalar settings of configs.py that choose
    the path and the blocks; the workspace is the key's own, so the stream and the thread are part of it (each
    call's kernels then use it in stream order)."""
    if (decode_plans.capacity <= 0 or per_call[0].device.type != "cuda" or not launch.replays_allowed()
            or torch.cuda.is_current_stream_capturing()):
        return None
    device = torch.cuda.current_device()
    return (device, torch._C._cuda_getCurrentRawStream(device), threading.get_ident(), top_k, renormalize,
            launch.PDL_ENABLED, moe_configs.SCAN_MAX_SLOTS, moe_configs.ROUTE_IN_GEMM1_MAX_TOKENS,
            moe_configs.SCHEDULE_KERNEL_MAX_SLOTS, moe_configs.SCHEDULE_KERNEL_MAX_EXPERTS, moe_configs.COMBINE_BLOCK_H,
            moe_configs.BLOCK_K, moe_configs.WIDE_HIDDEN, launch.tensors_key(per_call))


def decode_settings() -> tuple[int, ...]:
    """What native.cpp reads at every eager moe_infer call (mok/kernels/native): decode_plans.capacity (how many
    plans it keeps, 0: none), DECODE_PLAN_MAX_BYTES, then what its key holds besides the call's tensors: how many
    times decode_plans was cleared (a clear() after changing configs.py's dicts reaches its plans too) and the
    settings _decode_plan_key holds (PDL and configs.py's scalars)."""
    return (decode_plans.capacity, DECODE_PLAN_MAX_BYTES, decode_plans.generation, int(launch.PDL_ENABLED),
            moe_configs.SCAN_MAX_SLOTS, moe_configs.ROUTE_IN_GEMM1_MAX_TOKENS, moe_configs.SCHEDULE_KERNEL_MAX_SLOTS,
            moe_configs.SCHEDULE_KERNEL_MAX_EXPERTS, moe_configs.COMBINE_BLOCK_H, moe_configs.BLOCK_K,
            moe_configs.WIDE_HIDDEN)


# The layouts of a decode call's per-call tensors (moe_infer's), by what the call is given: the native path's site.
DECODE_ROUTE, DECODE_REPLAY, DECODE_WEIGHTS = 0, 1, 2


def decode_site(per_call: tuple, scalars: tuple) -> tuple:
    """The native path's site of an eager moe_infer call (mok/kernels/native): its launches on per_call as moe_infer
    lays it out (scalars: top_k, renormalize, the layout: DECODE_*), and its workspace (the plan keeps it)."""
    top_k, renormalize, layout = int(scalars[0]), bool(scalars[1]), int(scalars[2])
    logits_TE = ids_TK = weights_TK = None
    if layout == DECODE_WEIGHTS:
        x_TH, ids_TK, weights_TK, out_TH, w13_E2IH, w2_EHI = per_call
    elif layout == DECODE_REPLAY:
        x_TH, logits_TE, ids_TK, out_TH, w13_E2IH, w2_EHI = per_call
    else:
        x_TH, logits_TE, out_TH, w13_E2IH, w2_EHI = per_call
    return (_infer_into(out_TH, x_TH, logits_TE, w13_E2IH, w2_EHI, ids_TK, weights_TK, top_k, renormalize),)


def moe_infer(x_TH, logits_TE, w13_E2IH, w2_EHI, ids_TK, weights_TK, top_k: int, renormalize: bool,
              configs: dict | None = None, *, plan: bool = False) -> torch.Tensor:
    """A forward that saves nothing (no gradient needed): routing (or routing replay) and the experts -> out [T, H].

    ids_TK None: route the logits; ids_TK given and weights_TK None: their weights from the logits (replay);
    both given: the experts alone. The arithmetic of route / replay_weights followed by
    moe_forward(save_for_backward=False), so the same bits, with less host work: the intermediates (ids,
    weights, probabilities, the schedule and its tiles, act, y) are views of one workspace allocation (each
    piece 256-byte aligned, as a fresh allocation is) and no empty saved tensors are made; up to
    configs.SCAN_MAX_SLOTS slots the GEMMs scan the ids instead of a schedule (ScannedRoutes: the same row
    tiles, two launches fewer), and up to configs.ROUTE_IN_GEMM1_MAX_TOKENS tokens GEMM 1 routes them itself
    (route_token, the routing kernel's code: one launch fewer); up to DECODE_PLAN_MAX_BYTES of workspace a call
    replays the launches of the first call with its key (decode_plans).
    `configs` (tests) as in moe_forward; such calls are not planned. plan: whether this call may use a plan (a
    plan keeps its workspace, so not where a memory pool must not keep anything past the call, as in
    torch.compile's cudagraph trees: mok.moe plans only its plain eager calls, mok/ops/dispatch.py).
    """
    num_tokens, hidden = x_TH.shape
    out_TH = torch.empty(num_tokens, hidden, device=x_TH.device, dtype=x_TH.dtype)
    if num_tokens == 0:
        return out_TH
    x_TH = x_TH.contiguous()
    if weights_TK is not None:
        ids_TK, weights_TK = ids_TK.contiguous(), weights_TK.float().contiguous()
        per_call = (x_TH, ids_TK, weights_TK, out_TH, w13_E2IH, w2_EHI)
    else:
        logits_TE = logits_TE.contiguous()
        ids_TK = None if ids_TK is None else ids_TK.contiguous()
        per_call = (x_TH, logits_TE, out_TH, w13_E2IH, w2_EHI) if ids_TK is None else (
            x_TH, logits_TE, ids_TK, out_TH, w13_E2IH, w2_EHI)
    key = None
    workspace_bytes = num_tokens * top_k * (w2_EHI.shape[2] + hidden) * x_TH.element_size()  # act and y: the most
    if plan and configs is None and workspace_bytes <= DECODE_PLAN_MAX_BYTES:
        key = _decode_plan_key(per_call, top_k, renormalize)
    if key is None:
        _infer_into(out_TH, x_TH, logits_TE, w13_E2IH, w2_EHI, ids_TK, weights_TK, top_k, renormalize, configs)
        return out_TH
    decode_plans.call(key, per_call, lambda: (_infer_into(out_TH, x_TH, logits_TE, w13_E2IH, w2_EHI, ids_TK,
                                                          weights_TK, top_k, renormalize),))
    return out_TH


def _infer_into(out_TH, x_TH, logits_TE, w13_E2IH, w2_EHI, ids_TK, weights_TK, top_k: int, renormalize: bool,
                configs: dict | None = None) -> torch.Tensor:
    """moe_infer's launches, writing out_TH (x_TH, logits_TE, ids_TK and weights_TK contiguous, weights fp32);
    -> the workspace."""
    num_tokens, hidden = x_TH.shape
    num_experts, two_inter, _ = w13_E2IH.shape
    device, dtype = x_TH.device, x_TH.dtype
    num_slots = num_tokens * top_k
    cfg = pick_configs(num_slots, num_experts, configs, hidden=hidden)
    block_m = cfg["gemm1"]["BLOCK_M"]
    routes, weights_given = ids_TK is None, weights_TK is not None
    scanned = scans_routes(num_slots)
    route_in_gemm1 = routes and scanned and num_tokens <= moe_configs.ROUTE_IN_GEMM1_MAX_TOKENS
    schedule_numel = 0 if scanned else kernel_buffer_numel(num_slots, num_experts, block_m)
    pieces = {"act": ((num_slots, two_inter // 2), dtype), "y": ((num_slots, hidden), dtype),
              "schedule": ((schedule_numel,), torch.int32)}
    if not weights_given:
        pieces["weights"] = ((num_tokens, top_k), torch.float32)
    if routes:
        pieces["ids"] = ((num_tokens, top_k), torch.int32)
    if not weights_given and not route_in_gemm1:
        pieces["probs"] = ((num_tokens, num_experts), torch.float32)
    workspace, buffers = _workspace(device, pieces)
    act_NI, y_NH = buffers["act"], buffers["y"]
    ids_TK = buffers.get("ids", ids_TK)
    weights_TK = buffers.get("weights", weights_TK)
    if "probs" in buffers:
        launch_route(logits_TE, top_k, renormalize, None if routes else ids_TK,
                     out=(ids_TK if routes else None, weights_TK, buffers["probs"]))
    if scanned:
        schedule = ScannedRoutes(ids_TK, num_experts)
    else:
        schedule = Schedule(ids_TK, num_experts, block_m=block_m,
                            buffer_i32=buffers["schedule"] if schedule_numel else None)
    launch_gemm1(x_TH, w13_E2IH, schedule, top_k, False, cfg["gemm1"], act_NI=act_NI,
                 route=(logits_TE, weights_TK, renormalize) if route_in_gemm1 else None)
    launch_gemm2(act_NI, w2_EHI, y_NH, schedule, top_k, cfg["gemm2"])
    launch_combine(y_NH, weights_TK, out_TH, top_k, ids_TK, num_experts)
    return workspace


def moe_backward(grad_out_TH, x_TH, w13_E2IH, w2_EHI, ids_TK, weights_TK, gate_up_N2I, act_NI, y_NH,
                 sorted_slots_N, expert_start, configs: dict | None = None):
    """Gradients; same contract as mok.reference.moe.moe_backward:
    (d hidden [T, H], d w13 [E, 2I, H], d w2 [E, H, I], d topk_weights fp32 [T, K])."""
    backward = BackwardStages(grad_out_TH, x_TH, w13_E2IH, w2_EHI, ids_TK, weights_TK, gate_up_N2I, act_NI, y_NH,
                              sorted_slots_N, expert_start, configs)
    for _, run in backward.stages:
        run()
    return backward.result()


class BackwardStages:
    """moe_backward as named stages: `stages` lists (name, run) in order; running each once, in order,
    then result() gives moe_backward's tuple. Each stage reads only the inputs and what earlier stages
    stored on this object, so bench/moe_sweep.py may rerun one alone to time it.

    Layout flags (optional keys of the kernel configs, default 0; values are the same either way):
    SORTED_DY (bwd_act or weight_grad): d y is stored in schedule order (its rows are contiguous per
    expert: TMA-able A rows of bwd_act and d w2); SORTED_X (weight_grad): x is gathered once into
    schedule order for d w13 (a copy of N * H elements, so its rows are contiguous too).
    """

    def __init__(self, grad_out_TH, x_TH, w13_E2IH, w2_EHI, ids_TK, weights_TK, gate_up_N2I, act_NI, y_NH,
                 sorted_slots_N, expert_start, configs: dict | None = None):
        num_tokens = x_TH.shape[0]
        num_experts = w13_E2IH.shape[0]
        self.top_k = ids_TK.shape[1]
        self.schedule = Schedule(ids_TK, num_experts, sorted_slots_N, expert_start)
        self.cfg = pick_configs(self.schedule.num_slots, num_experts, configs, hidden=x_TH.shape[1])
        # inputs
        self.grad_out_TH = grad_out_TH.to(x_TH.dtype).contiguous()
        self.x_TH = x_TH.contiguous()
        self.w13_E2IH, self.w2_EHI = w13_E2IH, w2_EHI
        self.weights_TK = weights_TK.float().contiguous()
        self.gate_up_N2I, self.act_NI, self.y_NH = gate_up_N2I, act_NI, y_NH
        # results
        self.grad_hidden_TH = torch.empty_like(self.x_TH)
        self.grad_w13_E2IH = torch.empty_like(w13_E2IH)
        self.grad_w2_EHI = torch.empty_like(w2_EHI)
        self.grad_weights_TK: torch.Tensor | None = None
        # intermediates, stored by the stages
        self.row_of_slot_N: torch.Tensor | None = None
        self.grad_y_NH: torch.Tensor | None = None
        self.grad_gate_up_N2I: torch.Tensor | None = None
        self.grad_hidden_NH: torch.Tensor | None = None
        self.x_sorted_NH: torch.Tensor | None = None

        self.sorted_dy = bool(self.cfg["bwd_act"].get("SORTED_DY", 0) or self.cfg["weight_grad"].get("SORTED_DY", 0))
        if num_tokens == 0:
            self.grad_weights_TK = torch.zeros(0, self.top_k, device=x_TH.device, dtype=torch.float32)
            names = ["zero"]
        else:
            sorted_x = bool(self.cfg["weight_grad"].get("SORTED_X", 0))
            names = ["row_of_slot"] if self.sorted_dy else []
            names += ["combine_backward", "bwd_act", "bwd_dx", "combine_dx", "weight_grad_w2"]
            names += ["gather_x"] if sorted_x else []
            names += ["weight_grad_w13"]
        self._stage_names = names

    @property
    def stages(self) -> list[tuple[str, object]]:
        """(name, run) of each stage, in order. Built on demand: bound methods kept on the object would make a
        reference cycle that holds every gradient buffer until the cyclic garbage collector runs."""
        return [(name, getattr(self, name)) for name in self._stage_names]

    def result(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(d hidden [T, H], d w13 [E, 2I, H], d w2 [E, H, I], d topk_weights fp32 [T, K])."""
        return self.grad_hidden_TH, self.grad_w13_E2IH, self.grad_w2_EHI, self.grad_weights_TK

    @property
    def _dy_rows(self):
        """How a schedule position addresses d y: itself (SORTED_DY) or its slot."""
        return ROWS_POSITION if self.sorted_dy else ROWS_SLOT

    # stages, in order

    def zero(self) -> None:
        """No tokens: the weight gradients are zeros."""
        self.grad_w13_E2IH.zero_()
        self.grad_w2_EHI.zero_()

    def row_of_slot(self) -> None:
        """The inverse permutation of sorted_slots_N (each slot's schedule position)."""
        self.row_of_slot_N = self.schedule.row_of_slot()

    def combine_backward(self) -> None:
        self.grad_y_NH, self.grad_weights_TK = launch_combine_backward(
            self.grad_out_TH, self.y_NH, self.weights_TK, self.top_k, self.row_of_slot_N)

    def bwd_act(self) -> None:
        self.grad_gate_up_N2I = torch.empty(self.schedule.num_slots, self.w13_E2IH.shape[1], device=self.x_TH.device,
                                            dtype=self.x_TH.dtype)
        launch_bwd_act(self.grad_y_NH, self.w2_EHI, self.gate_up_N2I, self.grad_gate_up_N2I, self.schedule, self.top_k,
                       self.cfg["bwd_act"], dy_rows=self._dy_rows)

    def bwd_dx(self) -> None:
        self.grad_hidden_NH = torch.empty(self.schedule.num_slots, self.x_TH.shape[1], device=self.x_TH.device,
                                          dtype=torch.float32)
        launch_bwd_dx(self.grad_gate_up_N2I, self.w13_E2IH, self.grad_hidden_NH, self.schedule, self.top_k,
                      self.cfg["bwd_dx"])

    def combine_dx(self) -> None:
        launch_combine(self.grad_hidden_NH, None, self.grad_hidden_TH, self.top_k)

    def weight_grad_w2(self) -> None:
        launch_weight_grad_w2(self.grad_y_NH, self.act_NI, self.grad_w2_EHI, self.schedule, self.top_k,
                              self.cfg["weight_grad"], dy_rows=self._dy_rows)

    def gather_x(self) -> None:
        self.x_sorted_NH = self.schedule.gather_token_rows(self.x_TH, self.top_k)

    def weight_grad_w13(self) -> None:
        launch_weight_grad_w13(self.grad_gate_up_N2I, self.x_TH, self.grad_w13_E2IH, self.schedule, self.top_k,
                               self.cfg["weight_grad"], self.x_sorted_NH)
