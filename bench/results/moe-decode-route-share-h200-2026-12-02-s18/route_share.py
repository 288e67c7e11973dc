"""What would fusing routing into GEMM 1 buy at decode? The upper bound: T = 1 in a CUDA graph (bench/moe.py's
time_graph_ms: one replay between two events, and 20 back to back) with routing (mok.moe from router logits: the
routing kernel, GEMM 1, GEMM 2, the combine) against the same layer given its routes (topk_ids and topk_weights
from the same logits: GEMM 1, GEMM 2, the combine; no routing kernel), alternating, five rounds each, qwen3-30b-a3b
and olmoe-1b-7b. The two give the same bits (checked).

    PYTHONPATH=. python3 bench/results/moe-decode-route-share-h200-2026-12-02-s18/route_share.py
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from moe import BACK_TO_BACK, SHAPES, time_graph_ms  # noqa: E402  (bench/moe.py)

import mok  # noqa: E402


def main():
    for shape in ("qwen3-30b-a3b", "olmoe-1b-7b"):
        hidden, inter, num_experts, top_k = SHAPES[shape]
        gen = torch.Generator(device="cuda").manual_seed(1)
        w13 = (torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden ** 0.5).bfloat16()
        w2 = (torch.randn(num_experts, hidden, inter, device="cuda", generator=gen) / inter ** 0.5).bfloat16()
        x = torch.randn(1, hidden, device="cuda", generator=gen).bfloat16()
        logits = torch.randn(1, num_experts, device="cuda", generator=gen)
        ids, weights = mok.route(logits, top_k)

        def routed():
            with torch.no_grad():
                return mok.moe(x, logits, w13, w2, top_k)

        def given():
            with torch.no_grad():
                return mok.moe(x, logits, w13, w2, top_k, topk_ids=ids, topk_weights=weights)

        same_bits = bool(torch.equal(routed(), given()))
        rows = {}
        for _ in range(5):
            for name, fn in (("routed", routed), ("routes_given", given)):
                rows.setdefault(f"{name}_graph_ms", []).append(round(time_graph_ms(fn)[0], 4))
                rows.setdefault(f"{name}_back_to_back_ms", []).append(round(time_graph_ms(fn, BACK_TO_BACK)[0], 4))
        out = {"shape": shape, "same_bits": same_bits}
        for key, times in rows.items():
            out[key] = {"median": sorted(times)[len(times) // 2], "rounds": times}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
