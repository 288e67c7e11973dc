"""Host time of mok.rms_norm's and mok.linear's plain eager CUDA calls taken whole by the native path (sixteenth
session: dispatch.native_call, native.cpp's rms_norm_call and linear_call) against the same calls through the Python
checks and their EagerOp (the fifteenth session's path, native underneath) and torch, same process. Host wall clock
per call (bench/timing.py host_us: best of three means of 200 calls, no synchronisation inside a round); qwen3-30b-a3b's
hidden size, bf16, T = 4096 and 16384; also the pieces of a no-grad forward at T = 4096.
Run: PYTHONPATH=. python3 bench/results/host-probes-h200-2026-12-02-s16/whole_call_probe.py
"""
import time

import torch
import torch.nn.functional as F

import mok
from bench.timing import host_us
from mok.kernels import native
from mok.ops import dispatch

start = time.perf_counter()
module = native.load()
print(f"native.load(): {time.perf_counter() - start:.1f} s, {'built' if module else 'NOT AVAILABLE'}", flush=True)
whole_call = dispatch.native_call

H, O = 2048, 5120
for T in (4096, 16384):
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (1 + 0.1 * torch.randn(H, device="cuda")).bfloat16().requires_grad_()
    w_qkv = (0.02 * torch.randn(O, H, device="cuda")).bfloat16().requires_grad_()
    g, g2 = torch.randn(T, H, device="cuda", dtype=torch.bfloat16), torch.randn(T, H, device="cuda").bfloat16()
    g_qkv = torch.randn(T, O, device="cuda", dtype=torch.bfloat16)

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
        "rms_norm fwd": (lambda: F.rms_norm(x, (H,), w, 1e-6), lambda: mok.rms_norm(x, w, 1e-6)),
        "rms_norm residual fwd": (torch_fused, lambda: mok.rms_norm(x, w, 1e-6, r)),
        "rms_norm fwd+bwd": (fb(lambda: F.rms_norm(x, (H,), w, 1e-6), [x, w], g),
                             fb(lambda: mok.rms_norm(x, w, 1e-6), [x, w], g)),
        "rms_norm residual fwd+bwd": (fb(torch_fused, [x, r, w], (g, g2)),
                                      fb(lambda: mok.rms_norm(x, w, 1e-6, r), [x, r, w], (g, g2))),
        "linear fwd": (lambda: F.linear(x, w_qkv), lambda: mok.linear(x, w_qkv)),
        "linear fwd+bwd": (fb(lambda: F.linear(x, w_qkv), [x, w_qkv], g_qkv),
                           fb(lambda: mok.linear(x, w_qkv), [x, w_qkv], g_qkv)),
    }
    for name, (torch_fn, mok_fn) in cases.items():
        with torch.set_grad_enabled("bwd" in name):
            row = {"torch": host_us(torch_fn)}
            for path in ("whole call", "checks + EagerOp", "whole call"):
                dispatch.native_call = whole_call if path == "whole call" else (lambda *args: None)
                row[path] = host_us(mok_fn)
            dispatch.native_call = whole_call
        print(f"T={T} {name}: {row} torch/whole {row['torch'] / row['whole call']:.2f} "
              f"(checks + EagerOp {row['torch'] / row['checks + EagerOp']:.2f})", flush=True)
    if T == 4096:
        with torch.no_grad():
            xd, wd = x.detach(), w.detach()
            for name, fn in {"C++ rms_norm alone": lambda: module.rms_norm(xd, wd, 1e-6),
                             "C++ rms_norm_call alone": lambda: module.rms_norm_call(xd, wd, 1e-6, None),
                             "dispatch.native_call": lambda: dispatch.native_call("rms_norm_call", xd, wd, 1e-6, None),
                             "mok.rms_norm": lambda: mok.rms_norm(xd, wd, 1e-6),
                             "native.function": lambda: native.function("rms_norm_call"),
                             "torch.empty": lambda: torch.empty(T, H, dtype=xd.dtype, device=xd.device),
                             "F.rms_norm": lambda: F.rms_norm(xd, (H,), wd, 1e-6)}.items():
                print(f"T={T} no grad, {name}: {host_us(fn)} us", flush=True)
print("native stats (keys, unplanned, records, found):", native.stats())
