"""Routing inside GEMM 1 at decode, against the routing kernel before GEMM 1 and against the layer given its routes,
same process, alternating rounds (five), bench/moe.py's shapes and timing (time_graph_ms: one replay between two
events, and 20 back to back; time_ms for the eager call): mok.moe from router logits with
configs.ROUTE_IN_GEMM1_MAX_TOKENS = T (inside) and 0 (apart), and with topk_ids / topk_weights given (given).
T = 1, 2, 4, 8, 16 where the routes are scanned (T * K <= configs.SCAN_MAX_SLOTS). Each row says whether inside and
apart gave the same bits. Then the routing kernel alone, today's (pairwise_sum, one 64-bit max per k) against the
one before (route_kernel_before.py): ms per call at T = 1 in a CUDA graph and at T = 16384, and in how many of
16384 rows its weights' bits changed, with 1, 2 and 4 warps (the bits are the same for any).

    PYTHONPATH=. python3 bench/results/moe-decode-route-in-gemm1-2026-12-02-s19/route_in_gemm1_ab.py [routing]
        [shape:T,T,...]...
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))
from moe import BACK_TO_BACK, SHAPES, time_graph_ms, time_ms  # noqa: E402  (bench/moe.py)
from route_kernel_before import route_kernel_before  # noqa: E402

import mok  # noqa: E402
from mok.kernels.moe import configs  # noqa: E402
from mok.kernels.moe.routing import _route_kernel, route_blocks  # noqa: E402

ROUNDS = 5


def median(values):
    return sorted(values)[len(values) // 2]


def decode_rows(shapes, token_counts):
    for shape in shapes:
        hidden, inter, num_experts, top_k = SHAPES[shape]
        gen = torch.Generator(device="cuda").manual_seed(1)
        w13 = (torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden ** 0.5).bfloat16()
        w2 = (torch.randn(num_experts, hidden, inter, device="cuda", generator=gen) / inter ** 0.5).bfloat16()
        for num_tokens in token_counts:
            if num_tokens * top_k > configs.SCAN_MAX_SLOTS:
                continue
            x = torch.randn(num_tokens, hidden, device="cuda", generator=gen).bfloat16()
            logits = torch.randn(num_tokens, num_experts, device="cuda", generator=gen)
            ids, weights = mok.route(logits, top_k)

            def routed():
                with torch.no_grad():
                    return mok.moe(x, logits, w13, w2, top_k)

            def given():
                with torch.no_grad():
                    return mok.moe(x, logits, w13, w2, top_k, topk_ids=ids, topk_weights=weights)

            variants = {"inside": (num_tokens, routed), "apart": (0, routed), "given": (0, given)}
            outs, times = {}, {}
            for _ in range(ROUNDS):
                for name, (max_tokens, fn) in variants.items():
                    configs.ROUTE_IN_GEMM1_MAX_TOKENS = max_tokens
                    outs[name] = fn()
                    times.setdefault(f"{name}_graph_ms", []).append(time_graph_ms(fn)[0])
                    times.setdefault(f"{name}_back_to_back_ms", []).append(time_graph_ms(fn, BACK_TO_BACK)[0])
                    times.setdefault(f"{name}_eager_ms", []).append(time_ms(fn))
            configs.ROUTE_IN_GEMM1_MAX_TOKENS = 1
            row = {"shape": shape, "T": num_tokens,
                   "inside_equals_apart": bool(torch.equal(outs["inside"], outs["apart"])),
                   "inside_equals_given": bool(torch.equal(outs["inside"], outs["given"]))}
            for key, values in times.items():
                row[key] = round(median(values), 4)
                row[key + "_rounds"] = [round(v, 4) for v in values]
            print(json.dumps(row), flush=True)
        del w13, w2
        torch.cuda.empty_cache()


def route_rows():
    for num_experts, top_k in ((8, 2), (64, 8), (128, 8), (256, 8)):
        gen = torch.Generator(device="cuda").manual_seed(num_experts)
        logits = torch.randn(16384, num_experts, device="cuda", generator=gen) * 2
        row = {"E": num_experts, "K": top_k}
        results = {}
        for num_tokens in (1, 16384):
            part = logits[:num_tokens]
            ids = torch.empty(num_tokens, top_k, device="cuda", dtype=torch.int32)
            weights = torch.empty(num_tokens, top_k, device="cuda")
            probs = torch.empty(num_tokens, num_experts, device="cuda")
            blocks = route_blocks(num_experts, top_k)
            before_warps = 4 if blocks["BLOCK_E"] >= 256 else 1
            for name, kernel, warps in (("today_1warp", _route_kernel, 1), ("today_2warps", _route_kernel, 2),
                                        ("today_4warps", _route_kernel, 4),
                                        ("before", route_kernel_before, before_warps)):
                def run(kernel=kernel, warps=warps):
                    kernel[(num_tokens,)](part, ids, weights, probs, num_experts, part.stride(0), TOP_K=top_k,
                                          RENORMALIZE=True, REPLAY=False, PDL=False, num_warps=warps, **blocks)
                    return weights

                samples = []
                for _ in range(ROUNDS):
                    samples.append(time_graph_ms(run)[0] if num_tokens == 1 else time_ms(run))
                row[f"{name}_T{num_tokens}_{'graph_' if num_tokens == 1 else ''}ms"] = round(median(samples), 4)
                run()
                results[(name, num_tokens)] = (ids.clone(), weights.clone())
        today, before = results[("today_1warp", 16384)], results[("before", 16384)]
        row["ids_equal"] = bool(torch.equal(today[0], before[0]))
        row["rows_with_other_weight_bits"] = int((today[1].view(torch.int32) != before[1].view(torch.int32))
                                                 .any(dim=1).sum())
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}), flush=True)
    # argv: "routing" (the routing kernel rows) and/or shape names with ":T,T,..." (default all shapes, T = 1..16)
    wanted = sys.argv[1:] or ["routing", *(f"{shape}:1,2,4,8,16" for shape in SHAPES)]
    if "routing" in wanted:
        route_rows()
    for item in wanted:
        if item != "routing":
            shape, counts = item.split(":")
            decode_rows([shape], [int(c) for c in counts.split(",")])
