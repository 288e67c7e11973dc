"""Host time of mok.rms_norm's eager calls on the native eager path (mok/kernels/native) against the launchers' Python
plans and torch's F.rms_norm, same process (H200 machine, fourteenth session). Host wall clock per call (bench/timing.py
host_us: no synchronisation inside the timed loop, best of three means of 200 calls); qwen3-30b-a3b's hidden size,
bf16, with and without a residual, T = 4096 and 16384. Also the pieces of the native forward: the C++ function alone,
through its EagerOp, through mok.rms_norm (the public checks).
Run: PYTHONPATH=. python3 bench/results/host-probes-h200-2026-12-02-s14/native_probe.py
"""
import time

import torch
import torch.nn.functional as F

import mok
from bench.timing import host_us
from mok.kernels import native
from mok.ops import rms_norm as ops

start = time.perf_counter()
module = native.load()
print(f"native.load(): {time.perf_counter() - start:.1f} s, {'built' if module else 'NOT AVAILABLE'}", flush=True)

H = 2048
for T in (4096, 16384):
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (1 + 0.1 * torch.randn(H, device="cuda")).bfloat16().requires_grad_()
    g = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    g2 = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)  # one tensor for both outputs' gradients: no plan

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
        "fwd+bwd": (fb(lambda: F.rms_norm(x, (H,), w, 1e-6), [x, w], g),
                    fb(lambda: mok.rms_norm(x, w, 1e-6), [x, w], g)),
        "residual fwd+bwd": (fb(torch_fused, [x, r, w], (g, g2)),
                             fb(lambda: mok.rms_norm(x, w, 1e-6, r), [x, r, w], (g, g2))),
        "fwd": (lambda: F.rms_norm(x, (H,), w, 1e-6), lambda: mok.rms_norm(x, w, 1e-6)),
        "residual fwd": (torch_fused, lambda: mok.rms_norm(x, w, 1e-6, r)),
    }
    for name, (torch_fn, mok_fn) in cases.items():
        with torch.set_grad_enabled("bwd" in name):
            row = {"torch": host_us(torch_fn)}
            for path in ("native", "python plans", "native"):
                native.ENABLED = path == "native"
                row[path] = host_us(mok_fn)
            native.ENABLED = True
        best_mok = min(row["native"], row["python plans"])
        print(f"T={T} {name}: {row} torch/native {row['torch'] / row['native']:.2f} "
              f"(python plans {row['torch'] / row['python plans']:.2f}; best {row['torch'] / best_mok:.2f})", flush=True)
    if T == 4096:
        with torch.no_grad():
            xd, wd = x.detach(), w.detach()
            for name, fn in {"C++ rms_norm alone": lambda: module.rms_norm(xd, wd, 1e-6),
                             "its EagerOp": lambda: ops._rms_norm(xd, wd, 1e-6),
                             "mok.rms_norm": lambda: mok.rms_norm(xd, wd, 1e-6),
                             "torch.empty": lambda: torch.empty(T, H, dtype=xd.dtype, device=xd.device),
                             "F.rms_norm": lambda: F.rms_norm(xd, (H,), wd, 1e-6)}.items():
                print(f"T={T} no grad, {name}: {host_us(fn)} us", flush=True)
print("native stats (keys, unplanned, records, found):", native.stats())
