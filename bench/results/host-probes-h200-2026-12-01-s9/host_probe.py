"""Where the host time of mok's small calls goes on the H200 machine (ninth session): host wall clock per call
(no synchronisation inside the timed loop, best of three means) and cProfile's top functions by own time, for
  - rms_norm forward+backward at T = 4096 (qwen3-30b-a3b hidden): mok.rms_norm, the same two kernels called
    directly inside a torch.autograd.Function (no custom-op dispatch), and torch's F.rms_norm;
  - mok.moe's training forward (qwen3-30b-a3b, T = 16384, inputs requiring gradients) up to its return;
  - mok.moe's eager decode at T = 1 (no grad).
Run: PYTHONPATH=. python3 bench/results/host-probes-h200-2026-12-01-s9/host_probe.py"""
import cProfile
import gc
import pstats
import time

import torch
import torch.nn.functional as F

import mok
from bench.kernel_profile import moe_inputs
from mok.kernels import rms_norm as rms_kernels


def host_us(fn, n=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(3):
        s = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - s) / n * 1e6)
        torch.cuda.synchronize()
    return round(best, 1)


def top_own(fn, n=100, top=22):
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats
    rows = sorted(((own / n * 1e6, calls / n, f"{path.rsplit('/', 2)[-1]}:{line}({name})")
                   for (path, line, name), (calls, _, own, _, _) in stats.items()), reverse=True)[:top]
    for own, calls, name in rows:
        print(f"   {own:8.1f} us own  {calls:5.1f} calls  {name}")


class DirectRmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return rms_kernels.rms_norm(x, None, w, 1e-6)[0]

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx, _, gw = rms_kernels.rms_norm_backward(g.contiguous(), x, w, 1e-6, None, None)
        return gx, gw


T, H = 4096, 2048
x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = (1 + 0.1 * torch.randn(H, device="cuda")).bfloat16().requires_grad_()
g = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)


def fb(fn):
    def run():
        x.grad = w.grad = None
        torch.autograd.backward(fn(), g)
    return run


cases = {
    "mok.rms_norm fwd+bwd": fb(lambda: mok.rms_norm(x, w, 1e-6)),
    "direct autograd.Function fwd+bwd": fb(lambda: DirectRmsNorm.apply(x, w)),
    "torch F.rms_norm fwd+bwd": fb(lambda: F.rms_norm(x, (H,), w, 1e-6)),
}
with torch.no_grad():
    cases["mok.rms_norm fwd (no grad)"] = lambda: mok.rms_norm(x, w, 1e-6)
    cases["kernel rms_norm fwd (no grad)"] = lambda: rms_kernels.rms_norm(x, None, w, 1e-6)
print("gc thresholds", gc.get_threshold(), "objects", len(gc.get_objects()))
for name, fn in cases.items():
    if "no grad" in name:
        with torch.no_grad():
            print(f"{name}: {host_us(fn)} us", flush=True)
    else:
        print(f"{name}: {host_us(fn)} us", flush=True)
print("== cProfile mok.rms_norm fwd+bwd")
top_own(cases["mok.rms_norm fwd+bwd"])

xm, logits, w13, w2, top_k = moe_inputs("qwen3-30b-a3b", 16384)
leaves = [t.requires_grad_() for t in (xm, logits, w13, w2)]


def moe_fwd():
    return mok.moe(*leaves, top_k)


print(f"mok.moe training forward T=16384: {host_us(moe_fwd, n=20)} us", flush=True)
print("== cProfile mok.moe training forward T=16384")
top_own(moe_fwd, n=20)
x1, l1, w13b, w2b, top_k = moe_inputs("qwen3-30b-a3b", 1)
with torch.no_grad():
    print(f"mok.moe decode T=1: {host_us(lambda: mok.moe(x1, l1, w13b, w2b, top_k))} us", flush=True)
    print("== cProfile mok.moe decode T=1")
    top_own(lambda: mok.moe(x1, l1, w13b, w2b, top_k))
