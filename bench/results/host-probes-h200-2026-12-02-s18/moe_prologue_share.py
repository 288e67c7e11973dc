"""How much of mok.moe's forward+backward time at T = 16384 is the host's prologue? One process, qwen3-30b-a3b and
olmoe-1b-7b, three rounds alternating four timings (CUDA-event medians, bench/moe.py's time_ms):
  public_idle:   mok.moe(...).backward(grad) from an idle GPU, as bench/moe.py times it;
  public_ahead:  the same, with the GPU held busy (torch.cuda._sleep, ~2 ms) before the start event, so the host's
                 prologue runs while the GPU is still busy, as in a trainer's step where earlier layers' kernels run;
  kernels_idle:  mok.kernels.moe.layer.moe_forward + moe_backward on precomputed routes (bench/moe_sweep.py's layer
                 rows: no routing op, no autograd), from an idle GPU;
  kernels_ahead: the same with the GPU held busy first;
  public_back_to_back / kernels_back_to_back: ten calls enqueued without a synchronisation, mean per call (sustained
                 load: the host runs ahead and the GPU never idles).

    PYTHONPATH=. python3 bench/results/host-probes-h200-2026-12-02-s18/moe_prologue_share.py
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from moe import SHAPES, mok_moe  # noqa: E402  (bench/moe.py)

from mok.kernels.moe import layer  # noqa: E402

TOKENS = 16384
SLEEP_CYCLES = 4_000_000  # ~2 ms at the H200's clock: longer than the host's prologue


def median_ms(fn, ahead: bool, iters: int = 15) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if ahead:
            torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def back_to_back_ms(fn, calls: int = 10) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def main():
    for shape in ("qwen3-30b-a3b", "olmoe-1b-7b"):
        hidden, inter, num_experts, top_k = SHAPES[shape]
        gen = torch.Generator(device="cuda").manual_seed(0)
        w13 = (torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden ** 0.5).bfloat16()
        w2 = (torch.randn(num_experts, hidden, inter, device="cuda", generator=gen) / inter ** 0.5).bfloat16()
        x = torch.randn(TOKENS, hidden, device="cuda", generator=gen).bfloat16()
        logits = torch.randn(TOKENS, num_experts, device="cuda", generator=gen)
        grad_out = torch.randn(TOKENS, hidden, device="cuda", generator=gen).bfloat16()
        leaves = [t.detach().requires_grad_() for t in (x, logits, w13, w2)]
        ids, weights, _ = layer.route(logits, top_k, True)

        def public():
            for t in leaves:
                t.grad = None
            mok_moe(*leaves, top_k).backward(grad_out)

        def kernels():
            saved = layer.moe_forward(x, w13, w2, ids, weights, True)
            layer.moe_backward(grad_out, x, w13, w2, ids, weights, *saved[1:])

        rounds = {}
        for _ in range(3):
            for name, fn in (("public", public), ("kernels", kernels)):
                for ahead in (False, True):
                    key = f"{name}_{'ahead' if ahead else 'idle'}"
                    rounds.setdefault(key, []).append(round(median_ms(fn, ahead), 4))
                rounds.setdefault(f"{name}_back_to_back", []).append(round(back_to_back_ms(fn), 4))
        flops = 6 * TOKENS * top_k * hidden * inter * 3
        row = {"shape": shape, "tokens": TOKENS}
        for key, times in rounds.items():
            ms = sorted(times)[1]
            row[key] = {"ms": ms, "rounds_ms": times, "tflops": round(flops / ms / 1e9, 1)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
