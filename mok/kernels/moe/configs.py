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
# wait, while GEMM 1 runs; default 0), gemm2, bwd_act and bwd_dx optionally LEAN_EPILOGUE (the epilogue's
# addresses built after the K loop, 1: from int32 offsets where they fit, else as 2: from int64 row bases and int32
# columns; bwd_act: the SwiGLU backward on two column halves; fewer spilled registers, same bits; default 0).
# weight_grad: BLOCK_M,
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
    # bitwise identical to the previous configs. LEAN_EPILOGUE (bench/results/moe-sweep-h200-2026-12-01-s10.jsonl,
    # each kernel alone, ms, qwen3-30b-a3b / olmoe-1b-7b / deepseek-v3): gemm2 0.853 -> 0.812 / 1.099 -> 1.090 /
    # 7.56 -> 7.13; bwd_act (with 256 columns: 1.6 KB of spill with the epilogue in halves, 3.5 KB without)
    # 1.332 -> 1.133 / 1.618 -> 1.366 / 8.42 -> 7.19; bwd_dx (with TMA) 1.577 -> 1.499 / 1.894 -> 1.792 /
    # 14.75 -> 14.72 (4 stages: 1.538 / 1.764 / 14.56, even). Where an int32 offset could pass 2^31 (d gate_up of
    # 2^31 elements or more, e.g. deepseek-v3 at T >= 65536 on one rank) the launcher addresses rows by int64 bases
    # (LEAN_EPILOGUE 2): deepseek-v3's bwd_act at T = 65536 28.5 ms, against 43.5 with the plain epilogue it fell back
    # to before (bench/results/moe-sweep-deepseek-t65536-h200-2026-12-02-s11.jsonl). bwd_act: 128 columns and 3
    # stages, 0.973 vs 1.101 ms (qwen3) and 1.123 vs 1.335 (olmoe) against 256 columns
    # (bench/results/moe-sweep-h200-2026-12-02-s11.jsonl); hidden sizes from WIDE_HIDDEN keep 256.
    "large": {
        "gemm1": dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, TMA=1, num_warps=8, num_stages=4),
        "gemm2": dict(BLOCK_M=128, BLOCK_N=256, GROUP_M=8, TMA=1, LEAN_EPILOGUE=1, num_warps=8, num_stages=3),
        "bwd_act": dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, SORTED_DY=1, TMA=1, LEAN_EPILOGUE=1, num_stages=3,
                        num_warps=8),
        "bwd_dx": dict(BLOCK_M=128, BLOCK_N=256, GROUP_M=8, TMA=1, LEAN_EPILOGUE=1, num_stages=3, num_warps=8),
        "weight_grad": dict(BLOCK_M=128, BLOCK_N=256, SORTED_DY=1, SORTED_X=1, TMA=1, num_stages=3, num_warps=8),
    },
    # more than 2048 rows per expert (mixtral at T = 16384): few experts, long GEMMs (same sweeps; from the tenth
    # session's, alone, ms: gemm2 with GROUP_M 16 and 3 stages 5.46 -> 5.08, bwd_act LEAN_EPILOGUE 8.23 -> 7.00,
    # bwd_dx LEAN_EPILOGUE 11.58 -> 11.45; plain with GROUP_M 8 read 11.17, within the spread of one config's
    # timings, 10.4-11.6 ms: the config the GPU tests ran is kept)
    "xlarge": {
        "gemm1": dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, TMA=1, num_warps=8, num_stages=4),
        "gemm2": dict(BLOCK_M=128, BLOCK_N=256, GROUP_M=16, TMA=1, num_warps=8, num_stages=3),
        "bwd_act": dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, SORTED_DY=1, TMA=1, LEAN_EPILOGUE=1, num_stages=4,
                        num_warps=8),
        "bwd_dx": dict(BLOCK_M=128, BLOCK_N=256, GROUP_M=16, TMA=1, LEAN_EPILOGUE=1, num_stages=3, num_warps=8),
        "weight_grad": dict(BLOCK_M=128, BLOCK_N=256, SORTED_DY=1, SORTED_X=1, TMA=1, num_stages=3, num_warps=8),
    },
}
# Layers whose hidden size is at least WIDE_HIDDEN replace these entries of their size class. bwd_act's K loop runs
# over the hidden size: over a long one (deepseek-v3, 7168) 256 columns win, 7.74 vs 8.16 ms at T = 16384; over
# 2048 (qwen3, olmoe) the wide tile's SwiGLU-backward epilogue weighs more and 128 columns win (the large class).
WIDE_HIDDEN = 4096
WIDE_HIDDEN_CONFIGS: dict[str, dict[str, dict[str, int]]] = {
    "large": {
        "bwd_act": dict(BLOCK_M=128, BLOCK_N=256, GROUP_M=8, SORTED_DY=1, TMA=1, LEAN_EPILOGUE=1, num_stages=3,
                        num_warps=8),
    },
}
COMBINE_BLOCK_H = 1024
# Slots per program of the combine's backward (0: the K slots of one token). Each slot is computed alone, so any
# value gives the same bits (bench/moe_sweep.py times them and checks the bits).
# Measured at T = 16384 (bench/results/moe-sweep-h200-2026-12-02-s11.jsonl), ms for 0 / 1 / 2 / 4: deepseek-v3
# 1.500 / 1.084 / 1.081 / 1.205, qwen3-30b-a3b 0.333 / 0.376 / 0.326 / 0.355, olmoe-1b-7b 0.353 / 0.355 / 0.347 / 0.348.
COMBINE_BACKWARD_SLOTS = 2
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
# Up to this many tokens (and with the routes scanned), moe_infer given router logits routes inside GEMM 1
# (grouped_gemm._route_tokens, the routing kernel's code and bits): one launch fewer. Every GEMM 1 program routes
# every token, so only for the smallest batches; 0 disables it.
ROUTE_IN_GEMM1_MAX_TOKENS = 1

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


def pick_configs(num_slots: int, num_experts: int, override: dict | None = None,
                 hidden: int = 0) -> dict[str, dict[str, int]]:
    """The config of each kernel for this problem size (hidden: the layer's hidden size, for WIDE_HIDDEN_CONFIGS);
    `override` (tests) replaces whole entries."""
    size = size_class(num_slots, num_experts)
    configs = dict(CONFIGS[size])
    if hidden >= WIDE_HIDDEN:
        configs.update(WIDE_HIDDEN_CONFIGS.get(size, {}))
    if override:
        configs.update(override)
    return configs


def split_config(config: dict) -> tuple[int, int, int, int, bool, dict]:
    """-> (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, TMA, the rest: launch options (num_warps, num_stages) and, for
    gemm2, PREFETCH_K, and for the grouped GEMMs LEAN_EPILOGUE, which the launchers take out).

    The backward layout flags are dropped: they choose the data layout (layer.BackwardStages), not the launch.
    """
    cfg = {key: value for key, value in config.items() if key not in BACKWARD_LAYOUT_FLAGS}
    block_m, block_n = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
    block_k = cfg.pop("BLOCK_K", BLOCK_K)
    group_m = cfg.pop("GROUP_M", 1)
    tma = bool(cfg.pop("TMA", 0))
    return block_m, block_n, block_k, group_m, tma, cfg
