"""Does Triton 3.6 warp-specialise the MoE GEMMs' K loops on sm_90 (WARP_SPECIALIZE=1)? Runs each kernel once under a
warp-specialised config (qwen3-30b-a3b, T = 4096) and prints, for every compiled variant of the three GEMM kernels,
whether its TTGIR holds a ttg.warp_specialize region, with its warps, registers, spills and shared memory.

    PYTHONPATH=. python3 bench/results/moe-warp-specialize-h200-2026-12-02-s18/ws_probe.py
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from moe_sweep import Problem, _g, _w  # noqa: E402  (bench/moe_sweep.py)

from mok.kernels.moe import grouped_gemm  # noqa: E402

CONFIGS = {
    "gemm1": _g(128, 64, 4, 4, TMA=1, WARP_SPECIALIZE=1),
    "gemm2": _g(128, 128, 4, 3, TMA=1, LEAN_EPILOGUE=1, WARP_SPECIALIZE=1),
    "bwd_act": _g(128, 128, 4, 3, SORTED_DY=1, TMA=1, LEAN_EPILOGUE=1, WARP_SPECIALIZE=1),
    "bwd_dx": _g(128, 128, 4, 3, TMA=1, LEAN_EPILOGUE=1, WARP_SPECIALIZE=1),
    "weight_grad": _w(128, 128, 4, 3, TMA=1, SORTED_DY=1, SORTED_X=1, WARP_SPECIALIZE=1),
}

problem = Problem("qwen3-30b-a3b", 4096)
for kernel, cfg in CONFIGS.items():
    try:
        problem.run(kernel, cfg)
        torch.cuda.synchronize()
        print(json.dumps({"ran": kernel}), flush=True)
    except Exception as err:  # a compile failure is the answer
        print(json.dumps({"ran": kernel, "error": f"{type(err).__name__}: {str(err)[:400]}"}), flush=True)
for name in ("_gemm1_swiglu_kernel", "_grouped_gemm_kernel", "_weight_grad_kernel"):
    jit = getattr(grouped_gemm, name).kernel
    for device, cache in jit.device_caches.items():
        for compiled in cache[0].values():
            ttgir = compiled.asm.get("ttgir", "")
            meta = compiled.metadata
            print(json.dumps({"kernel": name, "warp_specialize_in_ttgir": "ttg.warp_specialize" in ttgir,
                              "tl.range ws attr": "tt.warp_specialize" in ttgir, "num_warps": meta.num_warps,
                              "shared": meta.shared, "n_regs": compiled.n_regs, "n_spills": compiled.n_spills}),
                  flush=True)
