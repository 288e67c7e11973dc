"""Is host work slower inside a CUDA backward (the autograd engine's device thread) than on the calling thread?
(H200 machine, thirteenth session.) The same pieces timed with perf_counter on the main thread and inside a
torch.autograd.Function's backward (medians of 200): three torch.empty, mok's rms_norm backward launcher
(two launches), 100 trivial Python additions; then mok.rms_norm's eager op with and without reshapes around it.
Run twice: as is, and under `taskset -c 0` (the process on one CPU, so the device thread wakes where the calling
thread ran).
Run: PYTHONPATH=. python3 bench/results/host-probes-h200-2026-12-02-s13/backward_thread_probe.py
"""
import statistics
import time

import torch
import torch.nn.functional as F

import mok
from mok.kernels import rms_norm as rms_kernels
from mok.ops import rms_norm as rms_ops

T, H = 4096, 2048
x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = (1 + 0.1 * torch.randn(H, device="cuda")).bfloat16().requires_grad_()
g = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)


def empties():
    for _ in range(3):
        torch.empty(T, H, dtype=torch.bfloat16, device="cuda")


def backward_launcher():
    rms_kernels.rms_norm_backward(g, x.detach(), w.detach(), 1e-6, None, None)


def python_loop():
    total = 0
    for i in range(100):
        total += i
    return total


PIECES = {"3x torch.empty": empties, "rms_norm_backward launcher": backward_launcher, "100 python adds": python_loop}
inside = {name: [] for name in PIECES}


class Timed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        for name, piece in PIECES.items():
            start = time.perf_counter()
            piece()
            inside[name].append(time.perf_counter() - start)
        return torch.empty_like(grad)


for _ in range(220):
    x.grad = None
    torch.autograd.backward(Timed.apply(x), g)
torch.cuda.synchronize()
for name, piece in PIECES.items():
    main = []
    for _ in range(220):
        start = time.perf_counter()
        piece()
        main.append(time.perf_counter() - start)
        if len(main) % 20 == 0:
            torch.cuda.synchronize()  # the GPU queue stays short, as inside the backward
    print(f"{name}: main thread {statistics.median(main[20:]) * 1e6:.1f} us, "
          f"inside backward {statistics.median(inside[name][20:]) * 1e6:.1f} us", flush=True)


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


def fb(fn):
    def run():
        x.grad = w.grad = None
        torch.autograd.backward(fn(), g)
    return run


for name, fn in {
    "torch F.rms_norm": lambda: F.rms_norm(x, (H,), w, 1e-6),
    "mok.rms_norm": lambda: mok.rms_norm(x, w, 1e-6),
    "EagerOp": lambda: rms_ops._rms_norm(x, w, 1e-6),
    "EagerOp, input reshaped": lambda: rms_ops._rms_norm(x.reshape(-1, H), w, 1e-6),
    "EagerOp, output reshaped": lambda: rms_ops._rms_norm(x, w, 1e-6).reshape(T, H),
}.items():
    print(f"{name} fwd+bwd: {host_us(fb(fn))} us", flush=True)
