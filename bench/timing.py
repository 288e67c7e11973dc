"""Timing on the GPU for the benchmarks: CUDA events around repeated calls, after warm-up calls; and the host's own
time per call (host_us), for the probes of where small calls spend their host time."""
from __future__ import annotations

import time

import torch


def cuda_ms(fn, warmup: int = 3, iters: int = 10) -> float:
    """Mean milliseconds per call of fn() over `iters` calls, measured with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def capture_graph(fn, repeat: int = 1) -> torch.cuda.CUDAGraph:
    """fn() `repeat` times captured in one CUDA graph, after one warm-up call on a side stream (the CUDA-graph
    recipe: Triton compiles and allocators settle outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn()
    return graph


def host_us(fn, calls: int = 200, rounds: int = 3) -> float:
    """Microseconds of host wall clock per call of fn(): the best of `rounds` means over `calls` calls, with no
    synchronisation inside a round (the GPU's queue absorbs the kernels), after ten warm-up calls."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return round(best, 1)
