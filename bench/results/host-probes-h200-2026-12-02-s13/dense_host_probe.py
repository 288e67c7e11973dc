"""Where the host time of an eager dense op's forward+backward goes on the H200 machine (thirteenth session).

Host wall clock per call (no synchronisation inside the timed loop, best of three means of 200 calls), on
qwen3-30b-a3b's sizes at T = 4096 (hidden 2048, qkv 5120 x 2048, bf16):
  - the autograd engine alone: a C++ node (a view's backward) and a Python torch.autograd.Function doing no
    device work (outputs from torch.empty_like), on CUDA and on CPU tensors (CUDA nodes run on the engine's
    device thread);
  - the hand-off to the device thread: perf_counter before torch.autograd.backward, at the Python backward's
    entry and exit, and after backward returns;
  - rms_norm: torch's F.rms_norm, mok.rms_norm, its EagerOp alone, a hand-written Function over the same kernels,
    the kernel launchers alone; linear the same way;
  - one launch: a CachedLaunch of the rms_norm kernel against Triton's own launch;
  - cProfile's top own-time functions of mok.rms_norm and mok.linear forward+backward (Python 3.12's cProfile
    sees every thread).
Run: PYTHONPATH=. python3 bench/results/host-probes-h200-2026-12-02-s13/dense_host_probe.py
"""
import cProfile
import pstats
import time

import torch
import torch.nn.functional as F

import mok
from mok.kernels import launch
from mok.kernels import linear as linear_kernels
from mok.kernels import rms_norm as rms_kernels
from mok.ops import linear as linear_ops
from mok.ops import rms_norm as rms_ops


def host_us(fn, n=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - start) / n * 1e6)
        torch.cuda.synchronize()
    return round(best, 1)


def top_own(fn, n=100, top=25):
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    rows = sorted(((own / n * 1e6, calls / n, f"{path.rsplit('/', 2)[-1]}:{line}({name})")
                   for (path, line, name), (calls, _, own, _, _) in pstats.Stats(prof).stats.items()),
                  reverse=True)[:top]
    for own, calls, name in rows:
        print(f"   {own:8.1f} us own  {calls:5.1f} calls  {name}")


class Empty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(w)


stamps = []


class Stamped(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, g):
        stamps.append(time.perf_counter())
        out = torch.empty_like(g), None
        stamps.append(time.perf_counter())
        return out


class DirectRmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return rms_kernels.rms_norm(x, None, w, 1e-6)[0]

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx, _, gw = rms_kernels.rms_norm_backward(g, x, w, 1e-6, None, None)
        return gx, gw


class DirectLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return linear_kernels.linear(x, w, None)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return (linear_kernels.bmm_nt(g[None], w.t()[None], x.dtype)[0],
                linear_kernels.bmm_nt(g.t()[None], x.t()[None], w.dtype)[0])


T, H, O = 4096, 2048, 5120
results = {}


def report(name, value):
    results[name] = value
    print(f"{name}: {value} us", flush=True)


def fb(fn, leaves, grad):
    def run():
        for leaf in leaves:
            leaf.grad = None
        torch.autograd.backward(fn(), grad)
    return run


for device in ("cuda", "cpu"):
    xs = torch.randn(T if device == "cuda" else 4, H if device == "cuda" else 8, device=device, requires_grad=True)
    ws = torch.randn(xs.shape[1], device=device, requires_grad=True)
    gs = torch.randn_like(xs)
    report(f"{device}: C++ view node fwd+bwd", host_us(fb(lambda: xs.view(-1), [xs], gs.view(-1))))
    report(f"{device}: empty Python Function fwd+bwd", host_us(fb(lambda: Empty.apply(xs, ws), [xs, ws], gs)))

xs = torch.randn(T, H, device="cuda", requires_grad=True)
gs = torch.randn_like(xs)
enter, leave = [], []
for _ in range(210):
    xs.grad = None
    out = Stamped.apply(xs, None)
    stamps.clear()
    start = time.perf_counter()
    torch.autograd.backward(out, gs)
    end = time.perf_counter()
    enter.append(stamps[0] - start)
    leave.append(end - stamps[1])
enter, leave = sorted(enter[10:]), sorted(leave[10:])
report("hand-off to the Python backward (median)", round(enter[len(enter) // 2] * 1e6, 1))
report("hand-off back from the Python backward (median)", round(leave[len(leave) // 2] * 1e6, 1))

x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = (1 + 0.1 * torch.randn(H, device="cuda")).bfloat16().requires_grad_()
g = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
wq = (0.02 * torch.randn(O, H, device="cuda")).bfloat16().requires_grad_()
gq = torch.randn(T, O, device="cuda", dtype=torch.bfloat16)

report("rms_norm torch F.rms_norm fwd+bwd", host_us(fb(lambda: F.rms_norm(x, (H,), w, 1e-6), [x, w], g)))
report("rms_norm mok.rms_norm fwd+bwd", host_us(fb(lambda: mok.rms_norm(x, w, 1e-6), [x, w], g)))
report("rms_norm EagerOp alone fwd+bwd", host_us(fb(lambda: rms_ops._rms_norm(x, w, 1e-6), [x, w], g)))
report("rms_norm direct Function fwd+bwd", host_us(fb(lambda: DirectRmsNorm.apply(x, w), [x, w], g)))
with torch.no_grad():
    report("rms_norm torch fwd (no grad)", host_us(lambda: F.rms_norm(x, (H,), w, 1e-6)))
    report("rms_norm mok fwd (no grad)", host_us(lambda: mok.rms_norm(x, w, 1e-6)))
    report("rms_norm kernels.rms_norm (no grad)", host_us(lambda: rms_kernels.rms_norm(x, None, w, 1e-6)))
    report("rms_norm kernels.rms_norm_backward", host_us(
        lambda: rms_kernels.rms_norm_backward(g, x, w, 1e-6, None, None)))
    report("torch.empty [4096, 2048] bf16", host_us(lambda: torch.empty(T, H, dtype=torch.bfloat16, device="cuda")))
    y = torch.empty_like(x)
    grid = (T,)
    args = (x, x, w, y, y, H, x.stride(0), x.stride(0), y.stride(0), y.stride(0), 1e-6)
    config = dict(HAS_RESIDUAL=False, **rms_kernels.rms_norm_config(H))
    report("one launch: CachedLaunch", host_us(lambda: rms_kernels._rms_norm_kernel[grid](*args, **config)))
    launch.CACHED_LAUNCH_ENABLED = False
    report("one launch: Triton's own", host_us(lambda: rms_kernels._rms_norm_kernel[grid](*args, **config)))
    launch.CACHED_LAUNCH_ENABLED = True
    report("linear torch fwd (no grad)", host_us(lambda: F.linear(x, wq)))
    report("linear mok fwd (no grad)", host_us(lambda: mok.linear(x, wq)))
report("linear torch F.linear fwd+bwd", host_us(fb(lambda: F.linear(x, wq), [x, wq], gq), n=50))
report("linear mok.linear fwd+bwd", host_us(fb(lambda: mok.linear(x, wq), [x, wq], gq), n=50))
report("linear direct Function fwd+bwd", host_us(fb(lambda: DirectLinear.apply(x, wq), [x, wq], gq), n=50))
print("== cProfile mok.rms_norm fwd+bwd")
top_own(fb(lambda: mok.rms_norm(x, w, 1e-6), [x, w], g))
print("== cProfile torch F.rms_norm fwd+bwd")
top_own(fb(lambda: F.rms_norm(x, (H,), w, 1e-6), [x, w], g), top=10)
print("== cProfile mok.linear fwd+bwd")
top_own(fb(lambda: mok.linear(x, wq), [x, wq], gq), n=50)
