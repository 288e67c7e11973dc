"""Where the host time goes between mok.moe's routing kernel and its first expert GEMM (the GPU idles there: the
prologue gaps of bench/kernel_profile.py's moe_train timeline). Wall-clock stamps (perf_counter) at the entry and
exit of each step of one forward (qwen3-30b-a3b shape, T = 16384, inputs requiring gradients), median of 30 calls
after a synchronisation each, in microseconds from the call's start; then the same for inference (no grad) and
for the T = 1 eager decode."""
import functools
import statistics
import time

import torch

import mok
import mok.kernels.moe as kernels
from bench.kernel_profile import moe_inputs
from mok.kernels.moe import grouped_gemm, layer, schedule

STAMPS: list[tuple[str, float]] = []


def stamped(owner, name, label):
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        STAMPS.append((f"{label} in", time.perf_counter()))
        try:
            return fn(*args, **kwargs)
        finally:
            STAMPS.append((f"{label} out", time.perf_counter()))

    setattr(owner, name, wrapper)


for owner, name, label in [
    (kernels, "route", "route cuda impl"), (layer, "launch_route", "launch_route"),
    (kernels, "moe_forward", "experts cuda impl"), (kernels, "moe_infer", "infer cuda impl"),
    (layer, "Schedule", "Schedule()"), (layer, "ScannedRoutes", "ScannedRoutes()"),
    (schedule.Schedule, "_launch", "schedule kernels"),
    (layer, "launch_gemm1", "launch_gemm1"), (grouped_gemm, "_descriptor", "TMA descriptor"),
    (layer, "launch_gemm2", "launch_gemm2"), (layer, "launch_combine", "launch_combine"),
]:
    stamped(owner, name, label)


def profile(label, tokens, grad):
    *tensors, top_k = moe_inputs("qwen3-30b-a3b", tokens)
    leaves = [t.requires_grad_(grad) for t in tensors]
    runs = []
    for i in range(35):
        torch.cuda.synchronize()
        STAMPS.clear()
        start = time.perf_counter()
        STAMPS.append(("mok.moe in", start))
        with torch.set_grad_enabled(grad):
            out = mok.moe(*leaves, top_k)
        STAMPS.append(("mok.moe out", time.perf_counter()))
        del out
        if i >= 5:
            runs.append([(name, (t - start) * 1e6) for name, t in STAMPS])
    print(f"== {label}: us from the call's start, median of {len(runs)}")
    for j, (name, _) in enumerate(runs[0]):
        print(f"{statistics.median(run[j][1] for run in runs):9.1f}  {name}")


profile("training forward T=16384", 16384, True)
profile("inference T=16384", 16384, False)
profile("decode T=1", 1, False)
