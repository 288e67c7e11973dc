"""The candidates bench/moe_sweep.py tries: launch configs per MoE kernel for the large size classes, decode
overrides timed end to end, and the backward's data-movement settings. Each candidate is kept only where its
outputs are bitwise those of today's config (bench/moe_sweep.py checks).
"""
from __future__ import annotations


def _g(bm, bn, warps, stages, **extra):
    return dict(BLOCK_M=bm, BLOCK_N=bn, GROUP_M=extra.pop("GROUP_M", 8), num_warps=warps, num_stages=stages, **extra)


def _w(bm, bn, warps, stages, **extra):
    return dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, **extra)


# Candidates for the large classes (hundreds to thousands of rows per expert). Shared memory per
# stage at BLOCK_K 64, bf16: (BM + BN) * 128 bytes (gemm1: BM + 2 BN); the H200 has 227 KiB.
CANDIDATES = {
    "gemm1": [
        _g(128, 128, 8, 3), _g(128, 128, 8, 3, TMA=1), _g(128, 128, 8, 4), _g(128, 128, 8, 4, TMA=1),
        _g(128, 64, 4, 4), _g(128, 64, 4, 4, TMA=1), _g(128, 128, 8, 3, GROUP_M=16), _g(64, 128, 4, 4),
    ],
    "gemm2": [
        # LEAN_EPILOGUE 2: the lean epilogue from int64 row bases and int32 columns (no 2^31 limit)
        _g(128, 256, 8, 3, TMA=1, LEAN_EPILOGUE=2), _g(128, 256, 8, 3, GROUP_M=16, TMA=1, LEAN_EPILOGUE=2),
        # the epilogue's addresses from int32 offsets (LEAN_EPILOGUE: fewer spilled registers)
        _g(128, 256, 8, 3, TMA=1, LEAN_EPILOGUE=1), _g(128, 256, 8, 4, TMA=1, LEAN_EPILOGUE=1),
        _g(128, 256, 8, 3, GROUP_M=16, TMA=1, LEAN_EPILOGUE=1),
        _g(128, 256, 8, 3), _g(128, 256, 8, 3, TMA=1), _g(128, 256, 8, 4), _g(128, 256, 8, 4, TMA=1),
        _g(128, 128, 8, 4), _g(128, 128, 8, 4, TMA=1), _g(256, 128, 8, 3, TMA=1), _g(64, 256, 4, 4),
        _g(128, 256, 8, 3, GROUP_M=16, TMA=1),
    ],
    "bwd_act": [
        # the epilogue with fewer live registers (LEAN_EPILOGUE: int32 offsets, the SwiGLU backward in column halves;
        # spills under Triton 3.6: docs/kernels.md); 2: int64 row bases
        _g(128, 256, 8, 3, SORTED_DY=1, TMA=1, LEAN_EPILOGUE=2),
        _g(128, 128, 8, 4, SORTED_DY=1, TMA=1, LEAN_EPILOGUE=2),
        _g(128, 128, 8, 4, SORTED_DY=1, TMA=1, LEAN_EPILOGUE=1), _g(64, 128, 4, 4, SORTED_DY=1, TMA=1, LEAN_EPILOGUE=1),
        _g(128, 256, 8, 3, SORTED_DY=1, TMA=1, LEAN_EPILOGUE=1), _g(64, 256, 4, 3, SORTED_DY=1, TMA=1, LEAN_EPILOGUE=1),
        _g(128, 256, 8, 3, GROUP_M=16, SORTED_DY=1, TMA=1, LEAN_EPILOGUE=1),
        _g(128, 128, 8, 3, SORTED_DY=1, TMA=1, LEAN_EPILOGUE=1),
        _g(128, 64, 8, 4), _g(128, 128, 8, 3), _g(128, 128, 8, 3, TMA=1), _g(128, 64, 4, 4), _g(64, 128, 4, 4),
        # d y in schedule order (SORTED_DY): contiguous A rows, through TMA with TMA=1
        _g(64, 128, 4, 4, SORTED_DY=1), _g(64, 128, 4, 4, SORTED_DY=1, TMA=1), _g(128, 128, 8, 3, SORTED_DY=1, TMA=1),
        _g(128, 128, 8, 4, SORTED_DY=1, TMA=1), _g(128, 64, 4, 4, SORTED_DY=1, TMA=1),
        _g(128, 128, 8, 3, GROUP_M=16, SORTED_DY=1, TMA=1), _g(128, 256, 8, 3, SORTED_DY=1, TMA=1),
    ],
    "bwd_dx": [
        _g(128, 256, 8, 3, TMA=1, LEAN_EPILOGUE=2), _g(128, 256, 8, 3, GROUP_M=16, TMA=1, LEAN_EPILOGUE=2),
        _g(128, 256, 8, 3, TMA=1, LEAN_EPILOGUE=1), _g(128, 256, 8, 4, TMA=1, LEAN_EPILOGUE=1),
        _g(128, 256, 8, 3, GROUP_M=16, TMA=1, LEAN_EPILOGUE=1),
        _g(128, 256, 8, 3), _g(128, 256, 8, 3, TMA=1), _g(128, 256, 8, 4), _g(128, 256, 8, 4, TMA=1),
        _g(128, 128, 8, 4, TMA=1), _g(256, 128, 8, 3, TMA=1), _g(128, 256, 8, 3, GROUP_M=16, TMA=1),
        _g(128, 256, 8, 4, GROUP_M=16, TMA=1), _g(128, 256, 8, 3, GROUP_M=4, TMA=1),
        _g(128, 256, 8, 3, GROUP_M=32, TMA=1), _g(128, 256, 8, 5, BLOCK_K=32, TMA=1),
    ],
    "weight_grad": [
        # small enough in shared memory and registers for two programs per SM, so that one program's epilogue
        # and pipeline fill overlap another's K loop (short K loops: a few hundred rows per expert; first: newest)
        _w(128, 128, 4, 3, TMA=1, SORTED_DY=1, SORTED_X=1), _w(128, 128, 4, 2, TMA=1, SORTED_DY=1, SORTED_X=1),
        _w(128, 128, 8, 3, TMA=1, SORTED_DY=1, SORTED_X=1), _w(64, 256, 4, 2, TMA=1, SORTED_DY=1, SORTED_X=1),
        _w(128, 128, 4, 3, BLOCK_K=32, TMA=1, SORTED_DY=1, SORTED_X=1),
        _w(128, 256, 8, 3), _w(128, 256, 8, 4), _w(128, 128, 8, 4), _w(128, 256, 8, 2, BLOCK_K=128),
        # TMA for the operands in schedule order (full row chunks); with SORTED_DY / SORTED_X both
        # operands of both weight gradients are in schedule order (the x gather is timed with it)
        _w(128, 256, 8, 3, TMA=1), _w(128, 256, 8, 3, SORTED_DY=1, SORTED_X=1),
        _w(128, 256, 8, 3, TMA=1, SORTED_DY=1, SORTED_X=1), _w(128, 256, 8, 4, TMA=1, SORTED_DY=1, SORTED_X=1),
        _w(128, 128, 8, 4, TMA=1, SORTED_DY=1, SORTED_X=1), _w(128, 128, 4, 4, TMA=1, SORTED_DY=1, SORTED_X=1),
        _w(256, 128, 8, 3, TMA=1, SORTED_DY=1, SORTED_X=1),
        _w(128, 256, 8, 2, BLOCK_K=128, TMA=1, SORTED_DY=1, SORTED_X=1),
        _w(128, 256, 8, 5, BLOCK_K=32, TMA=1, SORTED_DY=1, SORTED_X=1),
    ],
}

DECODE_CANDIDATES = [  # (label, override of the decode entries) at --decode-tokens, end to end
    ("gemm1 BK64 stages4 (before)", {"gemm1": _g(16, 32, 4, 4, GROUP_M=1)}),
    ("gemm1 BN64", {"gemm1": _g(16, 64, 4, 4, GROUP_M=1)}),
    ("gemm1 warps2", {"gemm1": _g(16, 32, 2, 4, GROUP_M=1)}),
    ("gemm1 stages6", {"gemm1": _g(16, 32, 4, 6, GROUP_M=1)}),
    ("gemm1 BK128", {"gemm1": _g(16, 32, 4, 3, GROUP_M=1, BLOCK_K=128)}),
    ("gemm1 BN16", {"gemm1": _g(16, 16, 4, 4, GROUP_M=1)}),
    ("gemm1 BN16 BK128", {"gemm1": _g(16, 16, 4, 4, GROUP_M=1, BLOCK_K=128)}),
    ("gemm1 BK256", {"gemm1": _g(16, 32, 4, 3, GROUP_M=1, BLOCK_K=256)}),
    ("gemm1 BK128 stages5", {"gemm1": _g(16, 32, 4, 5, GROUP_M=1, BLOCK_K=128)}),
    ("gemm2 BN32 BK128", {"gemm2": _g(16, 32, 4, 4, GROUP_M=1, BLOCK_K=128, PREFETCH_K=128)}),
    ("gemm2 BN16", {"gemm2": _g(16, 16, 4, 4, GROUP_M=1, PREFETCH_K=128)}),
    ("gemm2 BN32", {"gemm2": _g(16, 32, 4, 4, GROUP_M=1, PREFETCH_K=128)}),
    ("gemm2 BN128", {"gemm2": _g(16, 128, 4, 4, GROUP_M=1, PREFETCH_K=128)}),
    ("gemm2 BK64", {"gemm2": _g(16, 64, 4, 3, GROUP_M=1, PREFETCH_K=128)}),
    ("gemm2 LEAN 1", {"gemm2": _g(16, 64, 4, 3, GROUP_M=1, BLOCK_K=128, PREFETCH_K=128, LEAN_EPILOGUE=1)}),
    ("gemm2 LEAN 2", {"gemm2": _g(16, 64, 4, 3, GROUP_M=1, BLOCK_K=128, PREFETCH_K=128, LEAN_EPILOGUE=2)}),
    # batched decode (T = 64-256 on qwen3: 4-16 rows per expert): wide column tiles and long K steps, the shapes of
    # vLLM's tuned fused_moe table for this layer on the H200 (its configs/E=128,N=768,device_name=NVIDIA_H200.json)
    ("gemm1 BN128 BK128 stages2", {"gemm1": _g(16, 128, 4, 2, GROUP_M=1, BLOCK_K=128)}),
    ("gemm1 BN256 BK128 warps8", {"gemm1": _g(16, 256, 8, 2, GROUP_M=1, BLOCK_K=128)}),
    ("gemm1 BN64 BK128 stages3", {"gemm1": _g(16, 64, 4, 3, GROUP_M=1, BLOCK_K=128)}),
    ("gemm1 BM32 BN128 BK128", {"gemm1": _g(32, 128, 4, 2, GROUP_M=1, BLOCK_K=128)}),
    ("gemm2 BN128 BK128 stages2", {"gemm2": _g(16, 128, 4, 2, GROUP_M=1, BLOCK_K=128, PREFETCH_K=128)}),
    ("gemm2 BN256 BK128 warps8", {"gemm2": _g(16, 256, 8, 2, GROUP_M=1, BLOCK_K=128, PREFETCH_K=128)}),
    ("gemm2 BM32 BN128 BK128", {"gemm2": _g(32, 128, 4, 2, GROUP_M=1, BLOCK_K=128, PREFETCH_K=128)}),
    ("both BN128 BK128 stages2", {"gemm1": _g(16, 128, 4, 2, GROUP_M=1, BLOCK_K=128),
                                  "gemm2": _g(16, 128, 4, 2, GROUP_M=1, BLOCK_K=128, PREFETCH_K=128)}),
    ("TMA", "tma"),
    # weights of GEMM 2 prefetched into L2 while GEMM 1 runs (PDL): reduction elements per tile (today's: 128)
    ("gemm2 no prefetch", {"gemm2": _g(16, 64, 4, 3, GROUP_M=1, BLOCK_K=128)}),
    ("gemm2 prefetch 256", {"gemm2": _g(16, 64, 4, 3, GROUP_M=1, BLOCK_K=128, PREFETCH_K=256)}),
    ("gemm2 prefetch 512", {"gemm2": _g(16, 64, 4, 3, GROUP_M=1, BLOCK_K=128, PREFETCH_K=512)}),
    ("no PDL (so no prefetch)", "no pdl"),
    ("today again", {}),
]

KERNELS = ("gemm1", "gemm2", "bwd_act", "bwd_dx", "weight_grad")
BACKWARD_KERNELS = ("bwd_act", "bwd_dx", "weight_grad")


# The backward's data-movement launches: (stage, the configs.py setting it reads, values (the first is today's),
# the BackwardStages attributes it writes)
MOVE_CANDIDATES = [("combine_backward", "COMBINE_BACKWARD_SLOTS", (1, 0, 2, 4), ("grad_y_NH", "grad_weights_TK"))]
