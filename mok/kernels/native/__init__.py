"""mok's native eager path: the plain eager CUDA calls of mok.rms_norm and mok.linear with their autograd nodes in C++,
and mok.moe's inference calls (native.cpp; the launch plans they replay: plans.h, plans.cpp).

Why and what it costs: docs/kernels.md, "Native eager path". In short: at training sizes an eager call of a dense op
is host time, and a Python torch.autograd.Function alone costs most of torch's own F.rms_norm forward+backward. The
C++ forward, backward and autograd node replay the launches the Python launchers made for the same call (a
launch plan: mok/kernels/launch.py, LaunchPlan.export; tensor descriptors are encoded again at each replay), so
kernels, arguments and bits are the Python path's. An eager MoE decode call replays its plan with the workspace the
plan keeps (mok/kernels/moe/layer.py, decode_site), at most decode_plans.capacity of them.

The extension is built from native.cpp and plans.cpp with torch.utils.cpp_extension on the first plain eager CUDA
call (about a minute, once per machine: torch keeps the build in its extensions directory, TORCH_EXTENSIONS_DIR), or
ahead of time with `python -m mok.kernels.native`. Where it cannot be built (no C++ compiler or CUDA headers) mok
warns once and the Python path runs. MOK_NATIVE=0 in the environment, or `ENABLED = False`, turns it off.

Sites: `sites` maps the site numbers native.cpp uses to the Python launchers it records (each takes the call's tensors
in native.cpp's order and its scalars, and returns the tensors its launches keep reading, if any). Lower case on
purpose: rl/contract.py digests the upper-case constants of every mok.kernels module, and a function's repr holds its
address, which differs between processes.
"""
from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

import torch

from mok.kernels import launch
from mok.kernels import linear as linear_kernels
from mok.kernels import rms_norm as rms_norm_kernels
from mok.kernels.moe import layer as moe_kernels

ENABLED = True  # tests and benchmarks turn it off to run the Python path in the same process
# MOK_NATIVE=0 turns it off too; read apart from ENABLED so that the contract's digest of mok.kernels' upper-case
# constants (rl/contract.py) does not differ with the environment: the path changes no launch and no bit.
_disabled_by_environment = os.environ.get("MOK_NATIVE", "1") == "0"
CAPACITY = 64  # plans kept, every site together; the least recently used goes first

# The site numbers plans.h names kRmsNormSite, kRmsNormBackwardSite, kLinearSite, kLinearBackwardSite,
# kMoeDecodeSite (the two lists must agree).
RMS_NORM_SITE, RMS_NORM_BACKWARD_SITE, LINEAR_SITE, LINEAR_BACKWARD_SITE, MOE_DECODE_SITE = range(5)
sites = {RMS_NORM_SITE: rms_norm_kernels.forward_site, RMS_NORM_BACKWARD_SITE: rms_norm_kernels.backward_site,
         LINEAR_SITE: linear_kernels.forward_site, LINEAR_BACKWARD_SITE: linear_kernels.backward_site,
         MOE_DECODE_SITE: moe_kernels.decode_site}

_SOURCES = [str(Path(__file__).with_name(name)) for name in ("native.cpp", "plans.cpp")]
_lock = threading.Lock()
_module = None
_failed = False


def _run_site(site: int, per_call: list[torch.Tensor], scalars: list[float],
              record: bool) -> tuple[list | None, bool, list[torch.Tensor]]:
    """native.cpp's call back for a key without a plan: runs the site's launches on per_call and, with record, returns
    (them exported, or None where they cannot be replayed; True: native.cpp keeps that answer for the key; the
    tensors the plan keeps reading, which native.cpp holds with it: the MoE's workspace). Where plans are not
    allowed now (a backward whose forward ran before a profiler's hooks were set), the launches run unrecorded and
    the key stays unanswered: (None, False, [])."""
    launches = sites[site]
    if not record or not launch.replays_allowed():
        launches(tuple(per_call), tuple(scalars))
        return None, False, []
    with launch.record_launches() as recording:
        stable = launches(tuple(per_call), tuple(scalars)) or ()
    plan = launch.LaunchPlan.build(recording, per_call, stable, for_export=True)
    exported = None if plan is None else plan.export()
    return exported, True, ([] if exported is None else list(stable))


def load():
    """The built extension module (building it the first time), or None where it cannot be built (warned once)."""
    global _module, _failed
    with _lock:
        if _module is None and not _failed:
            try:
                from torch.utils import cpp_extension

                module = cpp_extension.load(name="mok_native", sources=_SOURCES, extra_cflags=["-O2"],
                                            with_cuda=True, verbose=False)
            except Exception as error:  # a missing compiler or header: the Python path runs instead
                _failed = True
                warnings.warn(f"mok: the native eager path could not be built, the Python path runs instead: "
                              f"{type(error).__name__}: {str(error).strip().splitlines()[-1:]}", stacklevel=2)
                return None
            module.set_site_runner(_run_site, moe_kernels.decode_settings)
            _module = module
            _configure()
    return _module


def function(name: str):
    """The native function `name` for a plain eager CUDA call now, or None: off (ENABLED, MOK_NATIVE=0), not
    buildable, or launch plans not allowed now (launch.replays_allowed: a profiler's launch hooks, Triton's debug
    knobs). A backward follows its forward's choice."""
    if not ENABLED or _disabled_by_environment or _failed or not launch.replays_allowed():
        return None
    module = _module if _module is not None else load()
    return None if module is None else getattr(module, name)


def _configure() -> None:
    """Drops every plan and hands native.cpp the settings it reads itself (the backward's BACKWARD_MAX_PROGRAMS)."""
    _module.configure(rms_norm_kernels.BACKWARD_MAX_PROGRAMS, CAPACITY)


def clear() -> None:
    """Drops every native plan and re-reads the settings: call it after changing a launcher's module settings that
    native keys do not hold (mok/kernels/rms_norm.py's BACKWARD_MAX_PROGRAMS, COLUMN_SUM, rms_norm_config;
    mok/kernels/linear.py's CONFIGS and row thresholds). The MoE decode's settings are in its keys, and
    decode_plans.clear() reaches its plans."""
    if _module is not None:
        _configure()


def stats() -> tuple[int, int, int, int]:
    """(keys held, keys without a plan, first calls recorded, calls that found their key); zeros before loading."""
    return tuple(_module.stats()) if _module is not None else (0, 0, 0, 0)
