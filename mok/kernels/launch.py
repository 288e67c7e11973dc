"""Programmatic dependent launch (PDL) for the Triton launchers on Hopper and later GPUs.

A kernel launched with PDL may be scheduled while the kernel before it in the stream still runs; in a
CUDA graph this hides most of the gap between two short kernels (a decode step's MoE is four kernels of
2-16 us). Safety rests on one rule, kept by every kernel launched this way: `wait_for_predecessor(PDL)` is
its first statement, in every program, before any global memory access. `griddepcontrol.wait` returns
only once the previous grid has completed and its writes are visible, so the kernel reads its inputs
and writes its outputs exactly as after an ordinary launch, and the values and bits do not change.
Completion is transitive: a grid completes only after its own wait returned, so a kernel also sees the
writes of every kernel before its predecessor. The dependents are released right after the wait: the
next kernel's programs may then take free SM slots and queue at their own wait.
One kernel reads before its wait, and only to prefetch: GEMM 2 of a decode step (mok/kernels/moe/grouped_gemm.py,
PREFETCH_K) guesses its tile from the ids and prefetches that tile's weights into L2 while GEMM 1 runs; what it
computes comes from the ids read again after the wait.
Without PDL (other GPUs, the interpreter, `PDL_ENABLED = False`) the kernels are compiled without these
instructions and launched as usual.

Measured on the H200 (bench/results/moe-decode-sweep-h200-2026-12-01-s6.jsonl and
moe-decode-sweep-pdl-h200-2026-12-01-s6.jsonl, MoE decode at T = 1 in CUDA graphs): PDL alone saves 1-2 us per
call on qwen3-30b-a3b and olmoe-1b-7b, with GEMM 2's prefetch 2-4 us. A long kernel of fewer programs than the
GPU has SMs is launched without it (`num_programs`): released early, its programs are placed while the
previous kernel still holds the SMs, and mixtral's GEMM 2 (128 programs streaming 235 MB) made the call 0.244
ms instead of 0.188, likely several of its programs sharing an SM and its bandwidth. The same kernels launch
with PDL in prefill and training too (the MoE forward+backward at T = 16384 moved within run-to-run noise).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

PDL_ENABLED = True  # the benchmarks and tests turn it off to run the same kernels without PDL in the same process
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def wait_for_predecessor(PDL: tl.constexpr):
    """First statement of a kernel launched with `pdl_options`: wait for the previous grid, then let the next
    one be scheduled."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@functools.cache
def _pdl_min_programs(device_index: int) -> int | None:
    """The SM count of a GPU that supports PDL (compute capability 9.0 and later), None for older ones."""
    props = torch.cuda.get_device_properties(device_index)
    return props.multi_processor_count if props.major >= 9 and torch.version.hip is None else None


def pdl_options(device: torch.device, num_programs: int | None = None) -> dict:
    """Keyword arguments of a launch: the kernel's PDL constexpr and Triton's `launch_pdl` option.
    num_programs: the grid size of a kernel that streams much data (the expert GEMMs), launched with PDL
    only when it has at least one program per SM; None for short kernels (routing, the combine)."""
    if _INTERPRET or not PDL_ENABLED or device.type != "cuda":
        return dict(PDL=False)
    min_programs = _pdl_min_programs(device.index if device.index is not None else torch.cuda.current_device())
    if min_programs is None or (num_programs is not None and num_programs < min_programs):
        return dict(PDL=False)
    return dict(PDL=True, launch_pdl=True)
