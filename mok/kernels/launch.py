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
Without PDL (other GPUs, the interpreter, `PDL_ENABLED = False`) the kernels are compiled without these
instructions and launched as usual.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

PDL_ENABLED = True  # bench/moe.py turns it off to time the same kernels without PDL in the same run
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def wait_for_predecessor(PDL: tl.constexpr):
    """First statement of a kernel launched with `pdl_options`: wait for the previous grid, then let the next
    one be scheduled."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@functools.cache
def _supports_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_options(device: torch.device) -> dict:
    """Keyword arguments of a launch: the kernel's PDL constexpr and Triton's `launch_pdl` option."""
    if _INTERPRET or not PDL_ENABLED or device.type != "cuda":
        return dict(PDL=False)
    enabled = _supports_pdl(device.index if device.index is not None else torch.cuda.current_device())
    return dict(PDL=enabled, launch_pdl=enabled)
