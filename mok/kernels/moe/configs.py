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
    # decode / tiny batches: memory-bound on the weights; many narrow column tiles keep every SM streaming.
    "decode": {
        # Why BLOCK_K 128 and 5 stages: 5% faster at 64 and 256 tokens on qwen3 (0.408 / 0.435 against 0.432 / 0.458
        # ms per layer in a graph on the H100, bench/moe_sweep.py --decode-tokens 64,256; the same bits).
        "gemm1": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=5),
        # Why BLOCK_K 128: 3% faster at T = 1 (mixtral, qwen3; olmoe even). PREFETCH_K 128: the first K step's
        # weights reach L2 while GEMM 1 runs, ~1 us on qwen3 / olmoe (more prefetch gains nothing).
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
    # 256 < rows per expert <= 2048 (qwen3, olmoe, deepseek-v3 at T = 16384): the best of bench/moe_sweep.py,
    # every candidate giving the same bits. Why: LEAN_EPILOGUE in gemm2, bwd_act and bwd_dx removes most register
    # spills (up to 15% per kernel); bwd_act takes 128 columns and 3 stages below WIDE_HIDDEN (the SwiGLU-backward
    # epilogue of a 256-column tile spills); past 2^31 elements the launcher switches to LEAN_EPILOGUE 2 (int64 row
    # bases), which keeps the lean epilogue's speed where the plain one would be 1.5x slower.
    "large": {
        "gemm1": dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, TMA=1, num_warps=8, num_stages=4),
        "gemm2": dict(BLOCK_M=128, BLOCK_N=256, GROUP_M=8, TMA=1, LEAN_EPILOGUE=1, num_warps=8, num_stages=3),
        "bwd_act": dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, SORTED_DY=1, TMA=1, LEAN_EPILOGUE=1, num_stages=3,
                        num_warps=8),
        "bwd_dx": dict(BLOCK_M=128, BLOCK_N=256, GROUP_M=8, TMA=1, LEAN_EPILOGUE=1, num_stages=3, num_warps=8),
        "weight_grad": dict(BLOCK_M=128, BLOCK_N=256, SORTED_DY=1, SORTED_X=1, TMA=1, num_stages=3, num_warps=8),
    },
    # more than 2048 rows per expert (mixtral at T = 16384): few experts, long GEMMs. Why: GROUP_M 16 and 3 stages
    # make gemm2 7% faster alone, LEAN_EPILOGUE bwd_act 15% (bwd_dx: within the spread of its timings).
    "xlarge": {
        "gemm1": dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, TMA=1, num_warps=8, num_stages=4),
        "gemm2": dict(BLOCK_M=128, BLOCK_N=256, GROUP_M=16, TMA=1, num_warps=8, num_stages=3),
        "bwd_act": dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, SORTED_DY=1, TMA=1, LEAN_EPILOGUE=1, num_stages=4,
                        num_warps=8),
        "bwd_dx": dict(BLOCK_M=128, BLOCK_N=256, GROUP_M=16, TMA=1, LEAN_EPILOGUE=1, num_stages=3, num_warps=8),
        "weight_grad": dict(BLOCK_M=128, BLOCK_N=256, SORTED_DY=1, SORTED_X=1, TMA=1, num_stages=3, num_warps=8),
    },
}
# Layers whose hidden size is at least WIDE_HIDDEN replace these entries of their size class. Why: bwd_act's K loop
# runs over the hidden size; over a long one (deepseek-v3, 7168) 256 columns win, over 2048 (qwen3, olmoe) the wide
# tile's SwiGLU-backward epilogue weighs more and 128 columns win.
WIDE_HIDDEN = 4096
WIDE_HIDDEN_CONFIGS: dict[str, dict[str, dict[str, int]]] = {
    "large": {
        "bwd_act": dict(BLOCK_M=128, BLOCK_N=256, GROUP_M=8, SORTED_DY=1, TMA=1, LEAN_EPILOGUE=1, num_stages=3,
                        num_warps=8),
    },
}
COMBINE_BLOCK_H = 1024
# Slots per program of the combine's backward (0: the K slots of one token). Each slot is computed alone, so any
# value gives the same bits. Why 2: wide hidden sizes (deepseek-v3, H = 7168) no longer put a token's K slots in one
# program (1.08 against 1.5 ms at T = 16384), the others within 2% (bench/moe_sweep.py times them and checks the bits).
COMBINE_BACKWARD_SLOTS = 2
# Up to this many slots the schedule and its tiles come from two Triton launches of one program per expert
# (schedule._sort_kernel, schedule._tiles_kernel); above, from torch ops (sort + searchsorted, about ten launches
# and as many again per BLOCK_M). Why: two launches instead of ~40 keep the GPU fed before GEMM 1 at training sizes;
# each program reads every id, so beyond this size the torch path (whose time hardly grows) is faster.
# 0 disables the kernels.
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
