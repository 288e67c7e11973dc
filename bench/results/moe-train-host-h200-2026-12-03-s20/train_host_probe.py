"""Where the host time of mok.moe's training forward goes at T = 16384 (qwen3-30b-a3b, olmoe-1b-7b): the GPU idles
between the routing kernel and the sort kernel and before GEMM 1 (bench/results/profile-moe-train-timeline-*).
Writes, under the folder given as argv[1]:
  cprofile-<shape>.txt   cProfile of 5 forward calls with gradients (host functions, cumulative time);
  trace-<shape>.json.gz  a torch.profiler trace (CPU, CUDA, Python stacks) of one forward+backward from an idle GPU;
  stamps-<shape>.json    wall-clock stamps (us from the call's start) of the forward's steps, median of 9 calls.

    PYTHONPATH=. python3 bench/results/moe-train-host-h200-2026-12-03-s20/train_host_probe.py $OUT
"""
import cProfile
import gzip
import io
import json
import os
import pstats
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from moe import SHAPES  # noqa: E402  (bench/moe.py)

import mok  # noqa: E402
from mok.kernels import moe as moe_kernels  # noqa: E402
from mok.kernels.moe import layer  # noqa: E402

TOKENS = 16384


def stamp_wrappers(stamps):
    """Wrap the forward's steps to record the wall-clock time at their entry and exit."""
    targets = [(moe_kernels, "route"), (layer, "launch_route"), (moe_kernels, "moe_forward"), (layer, "Schedule"),
               (layer, "launch_gemm1"), (layer, "launch_gemm2"), (layer, "launch_combine")]
    saved = []
    for target in targets:
        module, name = target
        fn = getattr(module, name)
        saved.append((module, name, fn))

        def wrapped(*a, __fn=fn, __name=name, **k):
            stamps.append((__name + ">", time.perf_counter()))
            out = __fn(*a, **k)
            stamps.append(("<" + __name, time.perf_counter()))
            return out
        setattr(module, name, wrapped)
    return saved


def main(out_dir):
    for shape in ("qwen3-30b-a3b", "olmoe-1b-7b"):
        hidden, inter, num_experts, top_k = SHAPES[shape]
        gen = torch.Generator(device="cuda").manual_seed(0)
        w13 = (torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden ** 0.5).bfloat16()
        w2 = (torch.randn(num_experts, hidden, inter, device="cuda", generator=gen) / inter ** 0.5).bfloat16()
        x = torch.randn(TOKENS, hidden, device="cuda", generator=gen).bfloat16()
        logits = torch.randn(TOKENS, num_experts, device="cuda", generator=gen)
        grad = torch.randn(TOKENS, hidden, device="cuda", generator=gen).bfloat16()
        leaves = [t.detach().requires_grad_() for t in (x, logits, w13, w2)]

        def fwd():
            return mok.moe(leaves[0], leaves[1], leaves[2], leaves[3], top_k)

        def fwd_bwd():
            for t in leaves:
                t.grad = None
            fwd().backward(grad)

        for _ in range(3):
            fwd_bwd()
        torch.cuda.synchronize()
        # cProfile of the forward alone
        prof = cProfile.Profile()
        outs = []
        for _ in range(5):
            torch.cuda.synchronize()
            prof.enable()
            outs.append(fwd())
            prof.disable()
            torch.cuda.synchronize()
            outs.clear()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(60)
        open(os.path.join(out_dir, f"cprofile-{shape}.txt"), "w").write(text.getvalue())
        # wall-clock stamps of the forward's steps
        runs = []
        for _ in range(9):
            stamps = []
            saved = stamp_wrappers(stamps)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fwd()
            t1 = time.perf_counter()
            for module, name, fn in saved:
                setattr(module, name, fn)
            torch.cuda.synchronize()
            del out
            runs.append([(n, round((t - t0) * 1e6, 1)) for n, t in stamps] + [("return", round((t1 - t0) * 1e6, 1))])
        mid = [sorted(r[i][1] for r in runs)[len(runs) // 2] for i in range(len(runs[0]))]
        json.dump({"shape": shape, "stamps_us": [(n, m) for (n, _), m in zip(runs[0], mid)]},
                  open(os.path.join(out_dir, f"stamps-{shape}.json"), "w"), indent=1)
        # torch.profiler trace of one forward+backward from idle
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA], with_stack=True) as p:
            fwd_bwd()
            torch.cuda.synchronize()
        path = os.path.join(out_dir, f"trace-{shape}.json")
        p.export_chrome_trace(path)
        with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(path)
        print(shape, "done", flush=True)
        w13 = w2 = x = logits = grad = leaves = outs = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1])
