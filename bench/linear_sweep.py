"""Sweep of mok.linear's matmul tile configs on the trainer step's GEMMs (forward, d x, d w of the lm_head and
the attention projections at 32768 tokens), next to torch.matmul (cuBLAS) on the same operands, same run.

    PYTHONPATH=. python bench/linear_sweep.py --out sweep.jsonl [--decode]
Every candidate's output must equal the current choice's bits (a row's bits do not depend on the tile:
docs/kernels.md); one that differs is reported and never chosen. One JSON line per (GEMM, candidate):
ms, TFLOP/s, cuBLAS ms, speed ratio to cuBLAS; the last line names the fastest candidate over all GEMMs.
--decode: the sampler's linears at 1 to 256 rows instead (the batch of a decode step; Qwen3-30B-A3B's and
Mixtral-8x7B's qkv, o_proj, router and lm_head), each CONFIGS entry for few rows and the decode candidates below
against cuBLAS (x @ w.T), timed as a decode step runs them: captured in a CUDA graph, one call per copy of the
weight (copies enough to stream from HBM, not L2), per call; with the weight read's GB/s and the program count.
"""
from __future__ import annotations

import argparse
import json

import torch

from bench.timing import capture_graph, cuda_ms
from mok.kernels import linear as kernels

TOKENS = 32768
LAYERS = {"lm_head": (2048, 151936), "qkv_proj": (2048, 5120), "o_proj": (4096, 2048)}  # (F, O)
CANDIDATES = {
    "current": None,
    "128x256x64 w8 s3 tma": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, TMA=1),
    "128x256x64 w8 s4 tma": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4, TMA=1),
    "256x128x64 w8 s3 tma": dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, TMA=1),
    "128x128x64 w8 s4 tma": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4, TMA=1),
    "128x128x64 w4 s4 tma": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4, TMA=1),
    "128x256x64 w8 s3 ptr": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    "128x256x128 w8 s2 tma": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=2, TMA=1),
    "small (before)": dict(kernels.CONFIGS["small"]),
}


def gemms():
    """(name, a [M, K], b [K, N]) of each layer's forward, d x and d w, laid out as mok.linear's backward reads them."""
    for layer, (features, outputs) in LAYERS.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(TOKENS, features, device="cuda", generator=gen).bfloat16()
        w = (torch.randn(outputs, features, device="cuda", generator=gen) * features ** -0.5).bfloat16()
        g = torch.randn(TOKENS, outputs, device="cuda", generator=gen).bfloat16()
        yield f"{layer} fwd", x, w.t()
        yield f"{layer} d x", g, w
        yield f"{layer} d w", g.t(), x


DECODE_ROWS = (1, 8, 16, 32, 64, 128, 256)
DECODE_LAYERS = {"qkv_proj": (2048, 5120), "o_proj": (4096, 2048), "router": (2048, 128), "lm_head": (2048, 151936),
                 "mixtral qkv_proj": (4096, 6144), "mixtral o_proj": (4096, 4096), "mixtral lm_head": (4096, 32000)}
# (a 16-column tile is no faster than 32.) GROUP_M 16: the 16-row tiles of one column run next to each other, so
# above 16 rows a weight tile is read from HBM once and from L2 by the other row tiles.
DECODE_CANDIDATES = {
    "small": kernels.CONFIGS["small"], "decode_n32": kernels.CONFIGS["decode_n32"],
    "decode_n64": kernels.CONFIGS["decode_n64"],
    "decode_n32 group16": dict(kernels.CONFIGS["decode_n32"], GROUP_M=16),
    "decode_n64 group16": dict(kernels.CONFIGS["decode_n64"], GROUP_M=16),
    "64x32x128 group4": dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=128, GROUP_M=4, num_warps=4, num_stages=4),
    "64x64x128 group4": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=4, num_warps=4, num_stages=4),
}
ROTATED_BYTES = 256 << 20  # weight copies per layer: more than the H200's L2 holds


def graph_ms_per_call(calls, num_calls: int) -> float:
    """ms per call of calls() (num_calls calls) captured in a CUDA graph, replays timed back to back."""
    graph = capture_graph(calls)
    ms = cuda_ms(graph.replay, warmup=2, iters=10) / num_calls
    graph.reset()
    return ms


def decode_sweep(out) -> None:
    for layer, (features, outputs) in DECODE_LAYERS.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        copies = max(1, -(-ROTATED_BYTES // (features * outputs * 2)))
        weights = [(torch.randn(outputs, features, device="cuda", generator=gen) * features ** -0.5).bfloat16()
                   for _ in range(copies)]
        for rows in DECODE_ROWS:
            x = torch.randn(rows, features, device="cuda", generator=gen).bfloat16()
            want = kernels.linear(x, weights[0], None)
            chosen = kernels.matmul_config(rows, outputs, x.dtype, True)
            cublas_ms = graph_ms_per_call(lambda: [x @ w.t() for w in weights], copies)
            timed = {}
            for name, config in DECODE_CANDIDATES.items():
                programs = kernels._programs(rows, outputs, config)
                row = dict(gemm=f"{layer} decode", rows=rows, candidate=name, chosen=config is chosen,
                           programs=programs, copies=copies, cublas_ms=round(cublas_ms, 4))
                try:
                    equal = torch.equal(kernels.matmul(x, weights[0].t(), config=config), want)
                    ms = graph_ms_per_call(lambda: [kernels.matmul(x, w.t(), config=config) for w in weights], copies)
                except Exception as error:  # reported, never chosen
                    row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                else:
                    row.update(equal_current=equal, ms=round(ms, 4), speed_vs_cublas=round(cublas_ms / ms, 3),
                               weight_gb_s=round(features * outputs * 2 / ms / 1e6, 1))
                    if equal:
                        timed[name] = ms
                print(json.dumps(row), flush=True)
                out.write(json.dumps(row) + "\n")
            if timed:
                best = min(timed, key=timed.get)
                chosen_name = next((n for n, c in DECODE_CANDIDATES.items() if c is chosen), None)
                row = dict(gemm=f"{layer} decode", rows=rows, best=best, best_ms=round(timed[best], 4),
                           chosen=chosen_name, chosen_ms=round(timed[chosen_name], 4) if chosen_name in timed else None,
                           best_vs_cublas=round(cublas_ms / timed[best], 3))
                print(json.dumps(row), flush=True)
                out.write(json.dumps(row) + "\n")
        weights = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--decode", action="store_true", help="the sampler's decode-size linears instead")
    args = parser.parse_args()
    if args.decode:
        with open(args.out, "w") as out:
            decode_sweep(out)
        return
    totals: dict[str, float] = {}
    with open(args.out, "w") as out:
        for name, a, b in gemms():
            flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
            cublas_ms = cuda_ms(lambda: a @ b, warmup=2, iters=5)
            want = kernels.matmul(a, b)
            for label, config in CANDIDATES.items():
                row = dict(gemm=name, candidate=label, cublas_ms=round(cublas_ms, 3))
                try:
                    equal = torch.equal(kernels.matmul(a, b, config=config), want)
                    ms = cuda_ms(lambda: kernels.matmul(a, b, config=config), warmup=2, iters=5)
                except Exception as error:  # a config that does not compile or fit is reported, not chosen
                    row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                    totals[label] = float("inf")
                else:
                    row.update(equal_current=equal, ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1),
                               speed_vs_cublas=round(cublas_ms / ms, 3))
                    if equal:
                        totals[label] = totals.get(label, 0.0) + ms
                    else:
                        totals[label] = float("inf")
                print(json.dumps(row), flush=True)
                out.write(json.dumps(row) + "\n")
        best = min(totals, key=totals.get)
        summary = dict(best=best, best_ms_sum=round(totals[best], 2),
                       ms_sums={k: round(v, 2) for k, v in totals.items()})
        print(json.dumps(summary))
        out.write(json.dumps(summary) + "\n")


if __name__ == "__main__":
    main()
