"""Where mok.linear's eager time goes at T = 4096 (linear_qkv of bench/dense.py: x [T, 2048] bf16, w [5120, 2048]),
against torch's x @ w.T, same process (H200 machine, fifteenth session). Per case: host wall clock per call
(bench/timing.py host_us: no synchronisation inside the timed loop), wall time per call with the GPU's queue drained
(cuda_ms), and the GPU's kernel time per call (torch.profiler, the sum of the device kernels' durations). mok on the
native eager path (mok/kernels/native) and on the Python path; a tree without mok.linear's native path (the first
output) runs the Python path for both.
Run: PYTHONPATH=. python3 bench/results/host-probes-h200-2026-12-02-s15/linear_probe.py
"""
import torch
from torch.profiler import ProfilerActivity, profile

import mok
from bench.timing import cuda_ms, host_us
from mok.kernels import native

torch.manual_seed(0)
F, O = 2048, 5120


def kernel_us(fn, calls=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total = sum(e.device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA"
                and not e.key.startswith(("cudaDeviceSynchronize",)))
    rows = sorted(((e.device_time_total / calls, e.key[:70]) for e in prof.key_averages()
                   if e.device_type.name == "CUDA"), reverse=True)[:6]
    return round(total / calls, 1), [(round(t, 1), k) for t, k in rows]


for T in (1024, 4096, 16384):
    x = torch.randn(T, F, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (0.02 * torch.randn(O, F, device="cuda")).bfloat16().requires_grad_()
    g = torch.randn(T, O, device="cuda", dtype=torch.bfloat16)

    def fb(fn):
        def run():
            x.grad = None
            w.grad = None
            torch.autograd.backward(fn(), g)
        return run

    cases = {"fwd": (lambda: x @ w.t(), lambda: mok.linear(x, w)),
             "fwd+bwd": (fb(lambda: x @ w.t()), fb(lambda: mok.linear(x, w)))}
    for name, (torch_fn, mok_fn) in cases.items():
        with torch.set_grad_enabled(name != "fwd"):
            for who, fn in (("torch", torch_fn), ("mok native", mok_fn), ("mok python", mok_fn)):
                native.ENABLED = who != "mok python"
                host = host_us(fn, calls=50)
                wall = cuda_ms(fn, warmup=3, iters=50) * 1e3
                gpu, top = kernel_us(fn)
                print(f"T={T} {name} {who}: host {host} us, wall {wall:.1f} us, kernels {gpu} us; {top}", flush=True)
