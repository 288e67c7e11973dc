"""How mok's Triton kernels launch: a cached launch path (host cost) and programmatic dependent launch (PDL).

Cached launch (`cached_launch`): every kernel mok launches is wrapped once where it is defined, and
`kernel[grid](*args, **kwargs)` then costs about a third of Triton's own launch on the host. Triton's
JITFunction.run binds the arguments and computes their specialization (pointer alignment, integer
divisibility, dtypes, constexprs), then builds a string key from it and the options, looks the compiled kernel
up, builds the launch metadata for the hooks and calls the compiled kernel's launcher, most of which the cached
path skips (docs/kernels.md, "Host cost per call"). The cached path runs Triton's own binder (the same
specialization, so the same compiled kernel whenever Triton would pick it) and keys a dict by its result;
the first launch of a specialization, any launch while Triton's launch hooks or the kernel's pre-run hooks are
set (profilers) or its debug or instrumentation knobs are on, callable grids and the interpreter go through
JITFunction.run unchanged. The kernel, its arguments and its grid are Triton's:
values and bits cannot differ, only the host work before the launch.

Launch plans (`record_launches`, `LaunchPlan`, `PlanCache`; `launch_planned` here): a call's launches recorded once
and replayed with other tensors' addresses, mok/kernels/launch_plans.py (its names are re-exported here).

The launch paths, from the outside in, of one eager CUDA call of mok.rms_norm, mok.linear or mok.moe's inference:
  1. the native path (mok/kernels/native, C++): the whole call's launches from one C++ function;
  2. launch plans (mok/kernels/launch_plans.py): the call's launches recorded once, replayed from Python;
  3. cached launches (`cached_launch`, here): one kernel at a time, Triton's binder, a dict lookup;
  4. Triton's own `JITFunction.run`.
Each path falls back to the next when it cannot run (MOK_NATIVE=0, no compiler; hooks or debug knobs set; a first
launch). All four launch the same compiled kernels with the same arguments: the bits are the same
(bench/launch_paths.py digests them). Kept because nothing else recovers their gain where it shows, `rl.generate`
at batch 1 (decode is host-bound there; rl.generate does not decode in CUDA graphs): on the H200, Qwen3-30B-A3B
4 layers, 172 tokens/s with all of them, 118 without the native path, 101 with Triton's launch alone; at batch 32
and in trainer steps the difference is within 3-10% (docs/performance.md, "Launch paths").

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
One kernel reads before its wait, and only to prefetch: GEMM 2 of a decode step (mok/kernels/moe/gemm2.py,
PREFETCH_K) guesses its tile from the ids and prefetches that tile's weights into L2 while GEMM 1 runs; what it
computes comes from the ids read again after the wait.
Without PDL (other GPUs, the interpreter, `PDL_ENABLED = False`) the kernels are compiled without these
instructions and launched as usual.

Why: in CUDA graphs PDL saves 1-2 us per MoE decode call at T = 1 (qwen3-30b-a3b, olmoe-1b-7b), 2-4 us with
GEMM 2's prefetch. A long kernel of fewer programs than the GPU has SMs is launched without it (`num_programs`):
released early, its programs are placed while the previous kernel still holds the SMs (mixtral's GEMM 2 ran 30%
slower). The same kernels launch with PDL in prefill and training too (no measurable change there).
"""
from __future__ import annotations

import functools
import os
import types
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

# re-exported: the launch plans are used through this module (mok.kernels.launch.LaunchPlan, ...)
from mok.kernels.launch_plans import (  # noqa: F401
    LaunchPlan,
    PlanCache,
    Recording,
    _recordings,
    record_launches,
    tensors_key,
)

PDL_ENABLED = True  # the benchmarks and tests turn it off to run the same kernels without PDL in the same process
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # Triton's interpreter runs the kernels (CPU tensors)
CACHED_LAUNCH_ENABLED = True  # the benchmarks and tests turn it off to time and compare Triton's own launch


class _Compiled(NamedTuple):
    """A compiled kernel as CachedLaunch keeps it."""

    run: object  # its launcher: scratch memory and tensor descriptors first, then the C launch function
    function: int
    packed_metadata: tuple
    direct: object | None  # that C launch function, where the launcher adds nothing to it (plans call it)
    cooperative: bool
    pdl: bool
    signature: tuple | None = None  # each argument's type as its launcher was built for ("constexpr": not passed)
    # Where the launcher's only addition is encoding host tensor descriptors: per descriptor argument, the compiled
    # kernel's tensor-map parameters (swizzle, element type, block). Only the native path replays such launches.
    descriptors: tuple | None = None


def _compiled(compiled) -> _Compiled:
    run = compiled.run
    direct = getattr(run, "launch", None)
    no_scratch = not (getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1))
    signature = getattr(getattr(compiled, "src", None), "signature", None)
    signature = None if signature is None else tuple(signature.values())
    descriptors = None
    if not isinstance(direct, types.BuiltinFunctionType):  # a Python wrapper: tensor descriptors are encoded there
        direct = None
        metas = getattr(getattr(compiled, "metadata", None), "tensordesc_meta", None)
        kinds = [kind for kind in signature or () if isinstance(kind, str) and kind.startswith("tensordesc")]
        if no_scratch and metas and len(metas) == len(kinds) and _direct_launch_layout():
            descriptors = tuple(dict(meta) for meta in metas)
    elif not no_scratch or not _direct_launch_layout():
        direct = None
    return _Compiled(run, compiled.function, compiled.packed_metadata, direct,
                     bool(getattr(run, "launch_cooperative_grid", False)), bool(getattr(run, "launch_pdl", False)),
                     signature, descriptors)


@functools.cache
def _direct_launch_layout() -> bool:
    """Whether the compiled kernels' C launch function takes the arguments LaunchPlan.launch passes: Triton 3.6's
    layout (grid, stream, function, cooperative, PDL, two scratch buffers, metadata, launch metadata, two hooks,
    then the kernel's arguments). Other Triton versions lay them out differently: no plans there."""
    try:
        from triton.backends.nvidia import driver
    except ImportError:
        return False
    return getattr(driver, "_BASE_ARGS_FORMAT", None) == "iiiKKppOOOOOO"


class CachedLaunch:
    """A @triton.jit kernel, launched as `kernel[grid](*args, **kwargs)` like the kernel itself (module doc).

    grid: a tuple of one to three ints (a callable grid goes through Triton's launch). The compiled kernels
    found are keyed by (device, the binder's specialization of the arguments, the launch options)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self._launchers: dict[tuple, _Compiled] = {}

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def _launch(self, grid, *args, **kwargs):
        kernel = self.kernel
        recording = getattr(_recordings, "active", None)
        if (not CACHED_LAUNCH_ENABLED or callable(grid) or kernel.pre_run_hooks or _launch_hooks_set()
                or _debug_knobs_set(kernel, kwargs)):
            if recording is not None:
                recording.replayable = False
            return kernel[grid](*args, **kwargs)
        device = torch.cuda.current_device()
        bound_args, specialization, options = kernel.device_caches[device][4](*args, **kwargs)
        key = (device, *specialization, *options.items())
        grid_xyz = (*grid, 1, 1)[:3]
        found = self._launchers.get(key)
        if found is None:
            compiled = kernel[grid](*args, **kwargs)
            if compiled is None:  # a jit_cache_hook told Triton not to compile
                if recording is not None:
                    recording.replayable = False
                return compiled
            found = self._launchers[key] = _compiled(compiled)
            if recording is not None:
                recording.add(found, grid_xyz, bound_args.values())
            return compiled
        for (name, _), (value, globals_dict) in kernel.used_global_vals.items():
            if globals_dict.get(name, _MISSING) != value:  # what Triton refuses: a global changed since compiling
                if recording is not None:
                    recording.replayable = False
                return kernel[grid](*args, **kwargs)
        found.run(*grid_xyz, torch._C._cuda_getCurrentRawStream(device), found.function, found.packed_metadata,
                  None, None, None, *bound_args.values())
        if recording is not None:
            recording.add(found, grid_xyz, bound_args.values())
        return None


def replays_allowed() -> bool:
    """Whether launch plans may be recorded and replayed now: mok's cached launches on, no launch hooks (profilers)
    and no debug or instrumentation knobs (each launch then goes through Triton's own path)."""
    return CACHED_LAUNCH_ENABLED and not _launch_hooks_set() and not _debug_knobs_on()


def launch_planned(plans: PlanCache, key: tuple, per_call: Sequence[torch.Tensor], run) -> None:
    """run(), a call's launches reading and writing only the tensors of per_call (on the current CUDA device), through
    `plans` where plans may be used (CUDA, replays_allowed()), with key plus the device and per_call's tensors_key as
    the plan's key: `key` holds the rest of what fixes the launches (the call's scalar arguments and settings)."""
    if INTERPRET or plans.capacity <= 0 or not per_call[0].is_cuda or not replays_allowed():
        run()
        return

    def run_keeping_nothing() -> tuple:
        run()  # (a launch returns Triton's compiled kernel the first time)
        return ()

    plans.call((*key, torch.cuda.current_device(), tensors_key(per_call)), per_call, run_keeping_nothing)


_MISSING = object()


def _debug_knobs_set(kernel, kwargs) -> bool:
    """Whether a launch asks for a debug or instrumented kernel (the two options JITFunction.run adds from Triton's
    knobs before binding, which the cache's key does not hold)."""
    return bool(kwargs.get("debug", kernel.debug)) or _debug_knobs_on()


def _debug_knobs_on() -> bool:
    """Whether Triton's own knobs ask every kernel to be compiled for debugging or instrumented."""
    return bool(triton.knobs.runtime.debug or triton.knobs.compilation.instrumentation_mode)


def _launch_hooks_set() -> bool:
    """Whether a launch hook is registered: Triton's hook chains (3.5 and later, never None) hold calls, or a hook
    was assigned directly."""
    hooks = triton.knobs.runtime
    enter, exit_ = hooks.launch_enter_hook, hooks.launch_exit_hook  # (no generator: this runs at every eager call)
    return ((enter is not None and bool(getattr(enter, "calls", True)))
            or (exit_ is not None and bool(getattr(exit_, "calls", True))))


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
