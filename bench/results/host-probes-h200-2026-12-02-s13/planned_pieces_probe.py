"""Written after this session's last device call, for the next GPU session (not run yet). Where the host time of
mok.rms_norm's planned eager calls goes now (T = 4096, qwen3-30b-a3b's hidden size, bf16): each piece of the forward's
path timed alone on the calling thread (bench/timing.py host_us), and the backward's launcher on the calling thread
and inside a CUDA backward (the engine's device thread; medians of 200). What it is for: choosing between moving the
backward's keying into the forward (the calling thread), keying only the inputs (the outputs are fresh allocations,
contiguous and 512-byte aligned), and fewer allocations in the backward.
Run: PYTHONPATH=. python3 bench/results/host-probes-h200-2026-12-02-s13/planned_pieces_probe.py
"""
import statistics
import time

import torch
import torch.nn.functional as F

import mok
from bench.timing import host_us
from mok.kernels import launch
from mok.kernels import rms_norm as kernels
from mok.ops import rms_norm as ops

T, H = 4096, 2048
x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
w = (1 + 0.1 * torch.randn(H, device="cuda")).bfloat16()
g = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
y = torch.empty_like(x)
per_call = (x, w, y)
kernels.rms_norm(x, None, w, 1e-6)  # records the forward's plan
(key, plan), = ((k, p) for k, p in kernels.plans.plans.items() if k[0] == "rms_norm")

with torch.no_grad():
    pieces = {
        "torch F.rms_norm": lambda: F.rms_norm(x, (H,), w, 1e-6),
        "mok.rms_norm": lambda: mok.rms_norm(x, w, 1e-6),
        "its EagerOp": lambda: ops._rms_norm(x, w, 1e-6),
        "kernels.rms_norm (planned)": lambda: kernels.rms_norm(x, None, w, 1e-6),
        "torch.empty": lambda: torch.empty(T, H, dtype=x.dtype, device=x.device),
        "launch.tensors_key(x, w, y)": lambda: launch.tensors_key(per_call),
        "launch.replays_allowed()": launch.replays_allowed,
        "PlanCache.call (a replay)": lambda: kernels.plans.call(key, per_call, None),
        "LaunchPlan.launch": lambda: plan.launch(per_call),
        "kernels.rms_norm_backward (planned)": lambda: kernels.rms_norm_backward(g, x, w, 1e-6, None, None),
    }
    for name, fn in pieces.items():
        print(f"{name}: {host_us(fn)} us", flush=True)

inside = []


class Timed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, leaf):
        return torch.empty_like(leaf)

    @staticmethod
    def backward(ctx, grad):
        start = time.perf_counter()
        kernels.rms_norm_backward(g, x, w, 1e-6, None, None)
        inside.append(time.perf_counter() - start)
        return torch.empty_like(grad)


leaf = x.detach().requires_grad_()
for _ in range(220):
    leaf.grad = None
    torch.autograd.backward(Timed.apply(leaf), g)
print(f"kernels.rms_norm_backward (planned) inside a backward, median: "
      f"{statistics.median(inside[20:]) * 1e6:.1f} us", flush=True)
