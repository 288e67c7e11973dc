"""Why mok.linear's kernels summed 6-10% longer per forward+backward on the native path than on the Python path in the
fifteenth session's probe (linear_qkv, T = 4096 and 16384; host-probes-h200-2026-12-02-s15/linear_probe.native.out.txt):
the same kernels and arguments, but the native path keeps the GPU busy back to back while the Python path, host-bound,
leaves it idle between launches. Here each path (and torch's x @ w.T) is timed both ways in one process: the device
kernels' summed duration per call (torch.profiler) with calls back to back, and with each call alone (synchronised,
then 2 ms idle), alternating twice. Equal kernel sums when spaced, different when back to back, would point at the
GPU's clocks under sustained load, not at the replayed launches.
Run: PYTHONPATH=. python3 bench/results/host-probes-h200-2026-12-02-s16/linear_spacing_probe.py
"""
import time

import torch
from torch.profiler import ProfilerActivity, profile

import mok
from mok.kernels import native

torch.manual_seed(0)
F, O = 2048, 5120


def kernel_us(fn, spaced: bool, calls: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
            if spaced:
                torch.cuda.synchronize()
                time.sleep(0.002)
        torch.cuda.synchronize()
    return round(sum(e.device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA"
                     and e.key.startswith(("_matmul_kernel", "nvjet", "sm90", "cutlass"))) / calls, 1)


assert native.load() is not None
for T in (4096, 16384):
    x = torch.randn(T, F, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (0.02 * torch.randn(O, F, device="cuda")).bfloat16().requires_grad_()
    grad = torch.randn(T, O, device="cuda", dtype=torch.bfloat16)

    def forward_backward(fn):
        def run():
            x.grad = w.grad = None
            fn().backward(grad)
        return run

    cases = {"torch": forward_backward(lambda: x @ w.T), "mok": forward_backward(lambda: mok.linear(x, w))}
    for round_ in range(2):
        for name, run in cases.items():
            for path in (("native", "python") if name == "mok" else ("cuBLAS",)):
                native.ENABLED = path != "python"
                row = {spacing: kernel_us(run, spacing == "spaced") for spacing in ("back to back", "spaced")}
                native.ENABLED = True
                print(f"T={T} round {round_} fwd+bwd {name} {path}: kernels us per call {row}", flush=True)
