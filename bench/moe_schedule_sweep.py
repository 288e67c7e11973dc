"""Sweep the MoE schedule kernels' launch (configs.SCHEDULE_KERNEL: slots per step of the sort, warps) on the
batches they serve, timing each inside a CUDA graph (no host overhead) next to the torch path (sort +
searchsorted) of the same batch, and checking every candidate's integers against the torch path (sorted
slots, expert starts, the row tiles of BLOCK_M 16): a candidate that differs is reported and never chosen.
The torch path's time says up to where the kernels should serve (configs.SCHEDULE_KERNEL_MAX_SLOTS).

    PYTHONPATH=. python bench/moe_schedule_sweep.py --out sweep.jsonl
Prints, per expert count, the fastest candidate over the batches (sum of times) next to the current config,
and per batch the current config's time and the torch path's.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from bench.timing import capture_graph
from mok.kernels.moe import configs
from mok.kernels.moe.schedule import Schedule

CASES = [(8, 2), (64, 8), (128, 8), (256, 8)]  # (experts, top-k): mixtral, olmoe, qwen3, deepseek-v3
TOKENS = [1, 16, 64, 256, 512, 1024, 2048]
SORT_CHUNKS = [256, 1024, 4096]
WARPS = [1, 2, 4, 8]


def graph_us(fn, repeat: int = 20, replays: int = 20) -> float:
    """Microseconds per call of fn() captured `repeat` times in one CUDA graph, median of `replays`."""
    graph = capture_graph(fn, repeat)
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
    current_key = (current["sort_chunk_slots"], current["num_warps"])
    saved_max_slots = configs.SCHEDULE_KERNEL_MAX_SLOTS
    rows, out = [], open(args.out, "w") if args.out else None
    try:
        for num_experts, top_k in CASES:
            for num_tokens in TOKENS:
                gen = torch.Generator(device="cuda").manual_seed(num_tokens)
                ids_TK = torch.rand(num_tokens, num_experts, device="cuda", generator=gen).topk(top_k, -1).indices
                ids_TK = ids_TK.to(torch.int32)
                configs.SCHEDULE_KERNEL_MAX_SLOTS = 0
                want = integers(Schedule(ids_TK, num_experts))  # the torch path
                torch_us = graph_us(lambda: Schedule(ids_TK, num_experts).tiles(16))
                configs.SCHEDULE_KERNEL_MAX_SLOTS = 1 << 30
                for chunk in SORT_CHUNKS:
                    for warps in WARPS:
                        configs.SCHEDULE_KERNEL = dict(current, sort_chunk_slots=chunk, num_warps=warps)
                        got = integers(Schedule(ids_TK, num_experts, block_m=16))
                        equal = all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
                        us = graph_us(lambda: Schedule(ids_TK, num_experts, block_m=16))
                        row = dict(experts=num_experts, top_k=top_k, tokens=num_tokens, sort_chunk_slots=chunk,
                                   num_warps=warps, us=round(us, 2), torch_path_us=round(torch_us, 2),
                                   equal_torch_path=equal)
                        rows.append(row)
                        if out:
                            out.write(json.dumps(row) + "\n")
                            out.flush()
    finally:
        configs.SCHEDULE_KERNEL, configs.SCHEDULE_KERNEL_MAX_SLOTS = current, saved_max_slots
        if out:
            out.close()
    bad = [r for r in rows if not r["equal_torch_path"]]
    for num_experts, _ in CASES:
        totals = {}
        for r in rows:
            if r["experts"] == num_experts and r["equal_torch_path"]:
                key = (r["sort_chunk_slots"], r["num_warps"])
                totals[key] = totals.get(key, 0.0) + r["us"]
        if not totals:
            continue
        best = min(totals, key=totals.get)
        now = totals.get(current_key)
        per_batch = {r["tokens"]: (r["us"], r["torch_path_us"]) for r in rows
                     if r["experts"] == num_experts and (r["sort_chunk_slots"], r["num_warps"]) == current_key}
        print(json.dumps(dict(experts=num_experts, best=best, best_us_sum=round(totals[best], 1),
                              current=current_key, current_us_sum=None if now is None else round(now, 1),
                              tokens_current_us_vs_torch_path_us=per_batch)))
    print(f"{len(rows)} candidates timed, {len(bad)} differ from the torch path", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
