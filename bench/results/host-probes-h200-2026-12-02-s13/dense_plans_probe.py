"""Host time of mok.rms_norm's eager calls with the launchers' plans on and off (mok/kernels/rms_norm.py `plans`),
beside torch's F.rms_norm, same process (H200 machine, thirteenth session, the tree with plans and without reshape
nodes). Host wall clock per call, no synchronisation inside the timed loop, best of three means of 200 calls; qwen3-30b-a3b's
hidden size, bf16, with and without a residual, T = 4096 and 16384.
Run: PYTHONPATH=. python3 bench/results/host-probes-h200-2026-12-02-s13/dense_plans_probe.py
"""
import time

import torch
import torch.nn.functional as F

import mok
from mok.kernels import rms_norm as rms_kernels


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


H = 2048
for T in (4096, 16384):
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (1 + 0.1 * torch.randn(H, device="cuda")).bfloat16().requires_grad_()
    g = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)

    def fb(fn, leaves, grads):
        def run():
            for leaf in leaves:
                leaf.grad = None
            torch.autograd.backward(fn(), grads)
        return run

    def torch_fused():
        h = x + r
        return F.rms_norm(h, (H,), w, 1e-6), h

    cases = {
        "torch F.rms_norm fwd+bwd": fb(lambda: F.rms_norm(x, (H,), w, 1e-6), [x, w], g),
        "mok.rms_norm fwd+bwd": fb(lambda: mok.rms_norm(x, w, 1e-6), [x, w], g),
        "torch add + F.rms_norm fwd+bwd": fb(torch_fused, [x, r, w], (g, g)),
        "mok.rms_norm residual fwd+bwd": fb(lambda: mok.rms_norm(x, w, 1e-6, r), [x, r, w], (g, g)),
    }
    with torch.no_grad():
        cases["torch F.rms_norm fwd"] = lambda: F.rms_norm(x, (H,), w, 1e-6)
        cases["mok.rms_norm fwd"] = lambda: mok.rms_norm(x, w, 1e-6)
    for name, fn in cases.items():
        row = {}
        for plans in ((32, 0) if name.startswith("mok") else (32,)):
            rms_kernels.plans.capacity = plans
            rms_kernels.plans.clear()
            with torch.set_grad_enabled("fwd+bwd" in name):
                row["plans on" if plans else "plans off"] = host_us(fn)
        rms_kernels.plans.capacity = 32
        print(f"T={T} {name}: {row}", flush=True)
