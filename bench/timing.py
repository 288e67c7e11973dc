"""Timing on the GPU for the benchmarks: CUDA events around repeated calls, after warm-up calls."""
from __future__ import annotations

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
