"""How mok's Triton kernels launch: a cached launch path (host cost) and programmatic dependent launch (PDL).

Cached launch (`cached_launch`): every kernel mok launches is wrapped once where it is defined, and
`kernel[grid](*args, **kwargs)` then costs about a third of Triton's own launch on the host. Triton's
JITFunction.run binds the arguments and computes their specialization (pointer alignment, integer
divisibility, dtypes, constexprs), then builds a string key from it and the options, looks the compiled kernel
up, builds the launch metadata for the hooks and calls the compiled kernel's launcher: measured 22.6 us per
launch of a seven-argument kernel on the H200 machine against 8.6 us for the launcher alone
(bench/results/host-probes-h200-2026-12-01-s7/). The cached path runs Triton's own binder (the same
specialization, so the same compiled kernel whenever Triton would pick it) and keys a dict by its result;
the first launch of a specialization, any launch while Triton's launch hooks or the kernel's pre-run hooks are
set (profilers) or its debug or instrumentation knobs are on, callable grids and the interpreter go through
JITFunction.run unchanged. The kernel, its arguments and its grid are Triton's:
values and bits cannot differ, only the host work before the launch.

Programmatic dependent launch, on Hopper and later GPUs:

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
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # Triton's interpreter runs the kernels (CPU tensors)
CACHED_LAUNCH_ENABLED = True  # the benchmarks and tests turn it off to time and compare Triton's own launch


class CachedLaunch:
    """A @triton.jit kernel, launched as `kernel[grid](*args, **kwargs)` like the kernel itself (module doc).

    grid: a tuple of one to three ints (a callable grid goes through Triton's launch). The compiled kernels
    found are keyed by (device, the binder's specialization of the arguments, the launch options)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self._launchers: dict[tuple, tuple] = {}

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def _launch(self, grid, *args, **kwargs):
        kernel = self.kernel
        if (not CACHED_LAUNCH_ENABLED or callable(grid) or kernel.pre_run_hooks or _launch_hooks_set()
                or _debug_knobs_set(kernel, kwargs)):
            return kernel[grid](*args, **kwargs)
        device = torch.cuda.current_device()
        bound_args, specialization, options = kernel.device_caches[device][4](*args, **kwargs)
        key = (device, *specialization, *options.items())
        found = self._launchers.get(key)
        if found is None:
            compiled = kernel[grid](*args, **kwargs)
            if compiled is not None:  # None: a jit_cache_hook told Triton not to compile
                self._launchers[key] = (compiled.run, compiled.function, compiled.packed_metadata)
            return compiled
        for (name, _), (value, globals_dict) in kernel.used_global_vals.items():
            if globals_dict.get(name, _MISSING) != value:  # what Triton refuses: a global changed since compiling
                return kernel[grid](*args, **kwargs)
        launcher, function, packed_metadata = found
        grid_x, grid_y, grid_z = (*grid, 1, 1)[:3]
        launcher(grid_x, grid_y, grid_z, torch._C._cuda_getCurrentRawStream(device), function, packed_metadata,
                 None, None, None, *bound_args.values())
        return None


_MISSING = object()


def _debug_knobs_set(kernel, kwargs) -> bool:
    """Whether a launch asks for a debug or instrumented kernel (the two options JITFunction.run adds from Triton's
    knobs before binding, which the cache's key does not hold)."""
    return bool(kwargs.get("debug", kernel.debug) or triton.knobs.runtime.debug
                or triton.knobs.compilation.instrumentation_mode)


def _launch_hooks_set() -> bool:
    """Whether a launch hook is registered: Triton's hook chains (3.5 and later, never None) hold calls, or a hook
    was assigned directly."""
    hooks = triton.knobs.runtime
    return any(hook is not None and bool(getattr(hook, "calls", True))
               for hook in (hooks.launch_enter_hook, hooks.launch_exit_hook))


def cached_launch(kernel):
    """Decorator over @triton.jit for the kernels mok launches: a CachedLaunch (the kernel itself under the
    interpreter, which launches differently)."""
    return kernel if INTERPRET else CachedLaunch(kernel)


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
    if INTERPRET or not PDL_ENABLED or device.type != "cuda":
        return dict(PDL=False)
    min_programs = _pdl_min_programs(device.index if device.index is not None else torch.cuda.current_device())
    if min_programs is None or (num_programs is not None and num_programs < min_programs):
        return dict(PDL=False)
    return dict(PDL=True, launch_pdl=True)
