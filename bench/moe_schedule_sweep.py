"""Sweep the one-program MoE schedule kernel's launch (configs.SCHEDULE_KERNEL: loop chunk, warps) on the
decode batches it serves, timing each inside a CUDA graph (no host overhead) and checking every candidate's
integers against the torch path (sorted slots, expert starts, the row tiles of BLOCK_M 16): a candidate that
differs is reported and never chosen.

    PYTHONPATH=. python bench/moe_schedule_sweep.py --out sweep.jsonl
Prints, per expert count, the fastest candidate over the batches (sum of times) next to the current config.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from mok.kernels.moe import configs
from mok.kernels.moe.schedule import Schedule

CASES = [(8, 2), (64, 8), (128, 8), (256, 8)]  # (experts, top-k): mixtral, olmoe, qwen3, deepseek-v3
TOKENS = [1, 16, 64, 128, 256]
CHUNKS = [16, 32, 64, 128]
WARPS = [1, 2, 4, 8, 16]


def graph_us(fn, repeat: int = 20, replays: int = 20) -> float:
    """Microseconds per call of fn() captured `repeat` times in one CUDA graph, median of `replays`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / repeat)
    return sorted(times)[len(times) // 2]


def integers(schedule: Schedule) -> list[torch.Tensor]:
    expert, row_start, num_tiles, _ = schedule.tiles(16)
    valid = int(num_tiles)
    return [schedule.sorted_slots_N, schedule.expert_start, expert[:valid], row_start[:valid]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    current = dict(configs.SCHEDULE_KERNEL)
    rows, out = [], open(args.out, "w") if args.out else None
    try:
        for num_experts, top_k in CASES:
            for num_tokens in TOKENS:
                gen = torch.Generator(device="cuda").manual_seed(num_tokens)
                ids_TK = torch.rand(num_tokens, num_experts, device="cuda", generator=gen).topk(top_k, -1).indices
                ids_TK = ids_TK.to(torch.int32)
                want = integers(Schedule(ids_TK, num_experts))  # the torch path
                for chunk in CHUNKS:
                    for warps in WARPS:
                        configs.SCHEDULE_KERNEL = dict(chunk={1 << 30: chunk}, num_warps=warps)
                        got = integers(Schedule(ids_TK, num_experts, block_m=16))
                        equal = all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
                        us = graph_us(lambda: Schedule(ids_TK, num_experts, block_m=16))
                        row = dict(experts=num_experts, top_k=top_k, tokens=num_tokens, chunk=chunk, num_warps=warps,
                                   us=round(us, 2), equal_torch_path=equal)
                        rows.append(row)
                        if out:
                            out.write(json.dumps(row) + "\n")
    finally:
        configs.SCHEDULE_KERNEL = current
        if out:
            out.close()
    bad = [r for r in rows if not r["equal_torch_path"]]
    for num_experts, _ in CASES:
        block_e = max(16, 1 << (num_experts - 1).bit_length())
        now_chunk = next((c for e, c in sorted(current["chunk"].items()) if block_e <= e),
                         max(current["chunk"].items())[1])
        totals = {}
        for r in rows:
            if r["experts"] == num_experts and r["equal_torch_path"]:
                key = (r["chunk"], r["num_warps"])
                totals[key] = totals.get(key, 0.0) + r["us"]
        best = min(totals, key=totals.get)
        now = totals.get((now_chunk, current["num_warps"]))
        print(json.dumps(dict(experts=num_experts, best_chunk=best[0], best_num_warps=best[1],
                              best_us_sum=round(totals[best], 1), current=[now_chunk, current["num_warps"]],
                              current_us_sum=None if now is None else round(now, 1))))
    print(f"{len(rows)} candidates timed, {len(bad)} differ from the torch path", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
