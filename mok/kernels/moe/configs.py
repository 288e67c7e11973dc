"""Kernel configurations of the MoE layer: one place, chosen from shapes in code, never autotuned.

Shapes: docs/shapes.md. Why a config may follow the token count: docs/kernels.md (a row's bits do
not depend on the tile shape when the reduction loop is sequential; tests/mok/test_moe_gpu.py
re-proves it for every kernel and every config below).
"""
from __future__ import annotations

BLOCK_K = 64  # the default reduction step; a config may set its own (bits do not depend on it: tests)

# Keyed by the size class of the average rows per active expert (see size_class). Keys of a
# GEMM entry: BLOCK_M, BLOCK_N, GROUP_M (row tiles per column sweep), num_warps, num_stages, and
# optionally BLOCK_K (default BLOCK_K) and TMA (1: weight tiles, and A tiles whose rows are
# contiguous, through TMA descriptors where the layout allows; default 0); gemm2 optionally PREFETCH_K (when it
# scans the routes: its weight tile's first PREFETCH_K reduction elements prefetched into L2 before its PDL
# wait, while GEMM 1 runs; default 0), bwd_act optionally GATE_UP_FIRST (the SwiGLU-backward epilogue's gate / up
# loads issued before the K loop; default 0). Fewer spilled registers, same bits, not yet timed on a GPU (so no
# config below uses them; default 0): gemm1's INT32_OFFSETS (x's rows and its stores addressed by int32 offsets);
# gemm2's, bwd_act's and bwd_dx's LEAN_EPILOGUE (the epilogue's addresses from int32 offsets, built after the K
# loop; bwd_act without GATE_UP_FIRST: the SwiGLU backward on two column halves). weight_grad: BLOCK_M,
# BLOCK_N, num_warps, num_stages, optionally BLOCK_K (rows per step), TMA (full row chunks of
# operands in schedule order). Backward layout flags (default 0, see
# layer.BackwardStages): SORTED_DY in bwd_act or weight_grad, SORTED_X in weight_grad. Tuned by bench/moe_sweep.py,
# which checks that every candidate gives the default's bits.
CONFIGS: dict[str, dict[str, dict[str, int]]] = {
    # decode / tiny batches: memory-bound on the weights; many narrow column tiles keep SMs busy.
    "decode": {
        "gemm1": dict(BLOCK_M=16, BLOCK_N=32, GROUP_M=1, num_warps=4, num_stages=4),
        # BLOCK_K 128: T=1 in a CUDA graph 0.194 vs 0.200 ms (mixtral), 0.0358 vs 0.0368 (qwen3), olmoe even
        # (bench/results/moe-decode-sweep-h200-2026-12-01.jsonl). PREFETCH_K 128 (the first K step's weights into
        # L2 while GEMM 1 runs): 20 replays back to back, qwen3 0.0293 vs 0.0306 / 0.0302 ms, olmoe 0.0336 vs
        # 0.0350 / 0.0347, mixtral and deepseek-v3 even; 256 and more no better or worse
        # (bench/results/moe-decode-sweep-pdl-h200-2026-12-01-s6.jsonl)
        "gemm2": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3, PREFETCH_K=128),
        "bwd_act": dict(BLOCK_M=16, BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=4),
        "bwd_dx": dict(BLOCK_M=16, BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=4),
        "weight_grad": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    },
    "small": {
        "gemm1": dict(BLOCK_M=64, BLOCK_N=64, GROUP_M=4, num_warps=4, num_stages=4),
        "gemm2": dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=4, num_warps=4, num_stages=4),
        "bwd_act": dict(BLOCK_M=64, BLOCK_N=64, GROUP_M=4, num_warps=4, num_stages=4),
        "bwd_dx": dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=4, num_warps=4, num_stages=4),
        "weight_grad": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3),
    },
    # 256 < rows per expert <= 2048 (qwen3, olmoe, deepseek-v3 at T = 16384). Chosen by bench/moe_sweep.py
    # on the H200 (2026-11-30): forward kernels from bench/results/moe-sweep-h200-2026-11-30.jsonl, backward
    # kernels from bench/results/moe-sweep-bwd-h200-2026-11-30.jsonl (deepseek-v3); every candidate was
    # bitwise identical to the previous configs.
    "large": {
        "gemm1": dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, TMA=1, num_warps=8, num_stages=4),
        "gemm2": dict(BLOCK_M=128, BLOCK_N=256, GROUP_M=8, TMA=1, num_warps=8, num_stages=3),
        # the SwiGLU-backward epilogue holds gate and up tiles beside the accumulator: narrower tiles. Its gate / up
        # loads issued before the K loop (GATE_UP_FIRST): bwd_act alone 1.357 -> 1.300 ms (qwen3-30b-a3b), 1.603 ->
        # 1.585 (olmoe-1b-7b), 8.257 -> 8.209 (deepseek-v3), same bits; other tiles with it were faster on one shape
        # and slower on another (bench/results/moe-sweep-bwd-h200-2026-12-01-s8.jsonl)
        "bwd_act": dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, SORTED_DY=1, TMA=1, GATE_UP_FIRST=1, num_stages=4,
                        num_warps=8),
        "bwd_dx": dict(BLOCK_M=128, BLOCK_N=256, GROUP_M=8, num_stages=4, num_warps=8),
        "weight_grad": dict(BLOCK_M=128, BLOCK_N=256, SORTED_DY=1, SORTED_X=1, TMA=1, num_stages=3, num_warps=8),
    },
    # more than 2048 rows per expert (mixtral at T = 16384): few experts, long GEMMs (same sweep)
    "xlarge": {
        "gemm1": dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, TMA=1, num_warps=8, num_stages=4),
        "gemm2": dict(BLOCK_M=128, BLOCK_N=256, GROUP_M=8, TMA=1, num_warps=8, num_stages=4),
        "bwd_act": dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, SORTED_DY=1, TMA=1, num_stages=4, num_warps=8),
        "bwd_dx": dict(BLOCK_M=128, BLOCK_N=256, GROUP_M=16, TMA=1, num_stages=3, num_warps=8),
        "weight_grad": dict(BLOCK_M=128, BLOCK_N=256, SORTED_DY=1, SORTED_X=1, TMA=1, num_stages=3, num_warps=8),
    },
}
COMBINE_BLOCK_H = 1024
# Up to this many slots the schedule and its tiles come from two Triton launches of one program per expert
# (schedule._sort_kernel, schedule._tiles_kernel); above, from torch ops (sort + searchsorted: about ten
# launches, and as many again for the tiles of each BLOCK_M, forward and backward). 0 disables the kernels.
# Measured on the H200 in CUDA graphs: 3-25 us up to 16384 slots against the torch path's 45-95 us at 8-256
# experts (bench/results/moe-schedule-sweep-h200-2026-12-01.jsonl); at 131072 slots (T = 16384, top-8) 87.8 vs
# 94.8 us (128 experts), 103.8 vs 96.0 (256), 18.0 vs 84.6 at 32768 slots of 8 experts. Each program reads every
# id, so the kernels' time grows with the slots while the torch path's hardly does. What the limit buys at
# training sizes is host time: the torch path's ~40 small launches left the GPU idle before GEMM 1 and before
# the backward's first GEMM; qwen3-30b-a3b forward+backward at T = 16384 went 9.98 -> 8.87-9.07 ms
# (bench/results/host-probes-h200-2026-12-01-s8/).
SCHEDULE_KERNEL_MAX_SLOTS = 131072
SCHEDULE_KERNEL_MAX_EXPERTS = 512
# Their launch: slots per step of _sort_kernel's two passes over the ids (as whole tokens), tiles per step of
# _tiles_kernel's stores, warps. Integer work: any choice gives the same integers (bench/moe_schedule_sweep.py
# checks each against the torch path while timing it).
SCHEDULE_KERNEL = dict(sort_chunk_slots=4096, tile_chunk=128, num_warps=8)  # the sweep's best at 64-256 experts

# Up to this many slots, moe_infer (inference and decode) builds no schedule: GEMM 1 and GEMM 2 scan the ids
# themselves (schedule.ScannedRoutes), two launches fewer; every program reads all ids, so only for small batches.
SCAN_MAX_SLOTS = 128

# The backward's data movement (Schedule.row_of_slot, Schedule.gather_token_rows): elements per program.
MOVE_ROWS = dict(index_block=1024, row_block=2048)

BACKWARD_LAYOUT_FLAGS = ("SORTED_DY", "SORTED_X")  # the backward's data layout, not launch options


def size_class(num_slots: int, num_experts: int) -> str:
    """The CONFIGS key of a problem: from the average rows per active expert."""
    rows_per_expert = num_slots / max(1, min(num_experts, num_slots))
    if rows_per_expert <= 16:
        return "decode"
    if rows_per_expert <= 256:
        return "small"
    if rows_per_expert <= 2048:
        return "large"
    return "xlarge"


def pick_configs(num_slots: int, num_experts: int, override: dict | None = None) -> dict[str, dict[str, int]]:
    """The config of each kernel for this problem size; `override` (tests) replaces whole entries."""
    configs = dict(CONFIGS[size_class(num_slots, num_experts)])
    if override:
        configs.update(override)
    return configs


def split_config(config: dict) -> tuple[int, int, int, int, bool, dict]:
    """-> (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, TMA, the rest: launch options (num_warps, num_stages) and, for
    gemm2, PREFETCH_K, for bwd_act, GATE_UP_FIRST, for gemm1, INT32_OFFSETS, and for the grouped GEMMs,
    LEAN_EPILOGUE, which the launchers take out).

    The backward layout flags are dropped: they choose the data layout (layer.BackwardStages), not the launch.
    """
    cfg = {key: value for key, value in config.items() if key not in BACKWARD_LAYOUT_FLAGS}
    block_m, block_n = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
    block_k = cfg.pop("BLOCK_K", BLOCK_K)
    group_m = cfg.pop("GROUP_M", 1)
    tma = bool(cfg.pop("TMA", 0))
    return block_m, block_n, block_k, group_m, tma, cfg
