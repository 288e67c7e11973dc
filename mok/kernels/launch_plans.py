"""Launch plans: what one call launches through CachedLaunch (mok/kernels/launch.py), recorded and replayed.

`record_launches`, `LaunchPlan`: the launches one call makes, recorded once and replayed by later
calls of the same shapes with the addresses of their own tensors put in. What a replay skips is all the host work
between the launches: the launchers' Python, the binder, and the driver's pointer query for every tensor argument
(Triton's compiled launcher calls cuPointerGetAttribute per tensor; a plan passes addresses). What a replay keeps
is the recorded call's arguments, grids and compiled kernels, so a plan may only be replayed where the call would
make the same launches again: same shapes, dtypes, pointer alignments, launch options and module settings (the
caller's key says so). A PlanCache holds one call site's plans by key (mok/kernels/moe/layer.py's decode calls of
moe_infer, which keep their workspace; mok/kernels/rms_norm.py's launchers, through launch_planned, which keep
nothing: docs/kernels.md). `LaunchPlan.export` hands a plan to the native eager path
(mok/kernels/native), which replays it from C++ and holds the tensors it keeps. A recording that cannot be
replayed gives no plan, and the call stays unplanned: a launch through Triton's own path, a kernel that needs
scratch memory, a launch reading a temporary of that call, or device work done by a torch op inside the recording
(anything but allocations and views), which a replay would not do. A kernel taking host tensor descriptors (TMA)
gives a plan only for export (`build(..., for_export=True)`): the native path encodes the descriptors at each replay.
"""
from __future__ import annotations

import contextlib
import struct
import threading
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _Recorded(NamedTuple):
    """One launch of a recording: what LaunchPlan.launch passes to the C launch function."""

    direct: object
    grid: tuple[int, int, int]
    function: int
    packed_metadata: tuple
    cooperative: bool
    pdl: bool
    signature: tuple | None
    args: tuple
    descriptors: tuple | None = None  # _Compiled.descriptors (then direct is None: only the native path replays it)


class Recording:
    """The launches CachedLaunch made inside one record_launches block, in order; `replayable` False when one of
    them cannot be replayed (module doc)."""

    def __init__(self):
        self.launches: list[_Recorded] = []
        self.replayable = True

    def add(self, found, grid: tuple[int, int, int], args) -> None:  # found: launch.py's _Compiled
        if found.direct is None and found.descriptors is None:
            self.replayable = False
        else:
            self.launches.append(_Recorded(found.direct, grid, found.function, found.packed_metadata, found.cooperative,
                                           found.pdl, found.signature, tuple(args), found.descriptors))


_recordings = threading.local()  # another thread's launches are not part of this thread's call


_ALLOCATIONS = (torch.ops.aten.empty, torch.ops.aten.empty_strided)


class _TorchOpWatch(TorchDispatchMode):
    """Leaves a recording unreplayable when a torch op other than an allocation or a view runs inside it: a replay
    makes only the recorded launches, so device work done by torch (a copy, a cast, an in-place write) would be
    missing from it."""

    def __init__(self, recording: Recording):
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (func.is_view or func.overloadpacket in _ALLOCATIONS):
            self.recording.replayable = False
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def record_launches():
    """`with record_launches() as recording:` collects, in `recording`, the launches this thread makes through
    CachedLaunch inside the block (they run as usual); a torch op inside it other than an allocation or a view
    leaves it unreplayable, and so does this block for a recording around it (which does not see these launches)."""
    recording, outer = Recording(), getattr(_recordings, "active", None)
    _recordings.active = recording
    try:
        with _TorchOpWatch(recording):
            yield recording
    finally:
        _recordings.active = outer
        if outer is not None:
            outer.replayable = False


class LaunchPlan:
    """A recording replayed with the addresses of another call's own tensors (module doc).

    Built from a recording and the recorded call's own tensors (`per_call`: its inputs and outputs, contiguous,
    given in the same order to every replay) and the tensors the plan may keep reading (`stable`: a workspace the
    plan holds on to). A tensor argument inside one of per_call becomes that tensor's address in
    the replaying call plus its recorded offset; one inside a stable tensor's storage stays the recorded address."""

    def __init__(self, launches: list[tuple[_Recorded, tuple[tuple[int, int, int], ...]]], kept: tuple):
        self._launches = launches
        self._kept = kept  # the storages recorded addresses point into stay allocated while the plan lives
        self.export_only = any(recorded.direct is None for recorded, _ in launches)  # tensor descriptors

    @classmethod
    def build(cls, recording: Recording, per_call: Sequence[torch.Tensor], stable: Sequence[torch.Tensor], *,
              for_export: bool = False) -> LaunchPlan | None:
        """The plan, or None where the recording cannot be replayed: a launch went through Triton's own path or
        needs what a replay does not give (module doc), or read a tensor that is neither in per_call nor in a
        stable tensor's storage (a temporary of the recorded call), or inside two of per_call. for_export: a plan
        for the native path (export), which also encodes host tensor descriptors: their bases are substituted as
        tensors are, and `launch` refuses such a plan."""
        if not recording.replayable or not recording.launches:
            return None
        spans = [(t.data_ptr(), t.numel() * t.element_size()) for t in per_call]
        storages = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in stable]
        launches = []
        for recorded in recording.launches:
            if recorded.direct is None and not for_export:
                return None
            args, substitutions = list(recorded.args), []
            for index, arg in enumerate(args):
                descriptor = recorded.descriptors is not None and isinstance(getattr(arg, "base", None), torch.Tensor)
                if isinstance(arg, torch.Tensor) or descriptor:
                    address = (arg.base if descriptor else arg).data_ptr()  # 0 without elements: nothing to read
                    owners = [] if address == 0 else [i for i, (start, size) in enumerate(spans)
                                                      if address == start or start <= address < start + size]
                    if len(owners) > 1:
                        return None
                    if owners:
                        substitutions.append((index, owners[0], address - spans[owners[0]][0]))
                    elif address and not any(start <= address < start + size for start, size in storages):
                        return None
                    if not descriptor:  # (a descriptor stays: export reads its shape, strides and block from it)
                        args[index] = address
                elif hasattr(arg, "data_ptr") or hasattr(arg, "base"):  # another pointer-like argument
                    return None
            launches.append((recorded._replace(args=tuple(args)), tuple(substitutions)))
        return cls(launches, tuple(t.untyped_storage() for t in stable))

    def launch(self, per_call: Sequence[torch.Tensor]) -> None:
        """The recorded launches, on the current device's current stream, with per_call's addresses (the same
        number of tensors, shapes, strides, dtypes and addresses modulo 16 as recorded: the caller's key), where
        replays_allowed(). A recording around the replay cannot see these launches: it becomes unreplayable."""
        if self.export_only:
            raise RuntimeError("mok: a launch plan with tensor descriptors replays only on the native path (export)")
        recording = getattr(_recordings, "active", None)
        if recording is not None:
            recording.replayable = False
        addresses = [t.data_ptr() for t in per_call]
        stream = torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())
        for recorded, substitutions in self._launches:
            args = recorded.args
            if substitutions:
                args = list(args)
                for index, source, offset in substitutions:
                    args[index] = addresses[source] + offset
            recorded.direct(*recorded.grid, stream, recorded.function, recorded.cooperative, recorded.pdl, None, None,
                            recorded.packed_metadata, None, None, None, *args)

    def export(self) -> list[tuple] | None:
        """The plan as the native eager path replays it (mok/kernels/native/native.cpp, plan_from_export), or None
        where it cannot: per launch (function, grid, threads per block, shared memory bytes, cooperative, PDL,
        params), params holding every argument the compiled kernel takes, in order, as (bits, -1), or as (offset,
        i) for the address of per_call[i] plus offset, then Triton's two scratch pointers (0: these kernels need
        none). The bits are those Triton's C launcher passes (driver.py's make_launcher: fp32 as float). A host
        tensor descriptor is what Triton's launcher makes of it: a tensor map, encoded at each replay from
        (offset, i, (data type, swizzle, element bytes, OOB fill, block, shape, strides)) as fill_tma_descriptor
        encodes it, then its shape (i32) and strides (i64)."""
        exported = []
        for recorded, substitutions in self._launches:
            num_warps, num_ctas, shared_bytes = recorded.packed_metadata
            if recorded.signature is None or len(recorded.signature) != len(recorded.args) or num_ctas != 1:
                return None
            sources = {index: (offset, source) for index, source, offset in substitutions}
            descriptors = iter(recorded.descriptors or ())
            params = []
            for index, (kind, arg) in enumerate(zip(recorded.signature, recorded.args)):
                if kind == "constexpr":
                    continue
                if isinstance(kind, str) and kind.startswith("tensordesc"):
                    descriptor = _descriptor_params(arg, next(descriptors, None), sources.get(index))
                    if descriptor is None:
                        return None
                    params += descriptor
                    continue
                bits = sources.get(index) or _param_bits(kind, arg)
                if bits is None:
                    return None
                params.append(bits)
            params += [(0, -1), (0, -1)]
            exported.append((recorded.function, recorded.grid, 32 * num_warps, shared_bytes, recorded.cooperative,
                             recorded.pdl, params))
        return exported


_INT_BITS = {"i1": 8, "u1": 8, "i8": 8, "u8": 8, "i16": 16, "u16": 16, "i32": 32, "u32": 32, "i64": 64, "u64": 64}


def _param_bits(kind, value) -> tuple[int, int] | None:
    """(the parameter's bits, -1) as Triton's launcher passes an argument of type `kind`; None for types the
    native path does not pass (tuples, tensor descriptors, fp16/bf16 scalars)."""
    if not isinstance(kind, str):
        return None
    if kind.startswith("*"):
        return int(value) % 2**64, -1
    if kind in _INT_BITS:
        return int(value) % 2 ** _INT_BITS[kind], -1
    try:
        if kind in ("fp32", "f32"):
            return struct.unpack("<I", struct.pack("<f", value))[0], -1
        if kind == "fp64":
            return struct.unpack("<Q", struct.pack("<d", value))[0], -1
    except (OverflowError, struct.error):
        return None
    return None


def _descriptor_params(descriptor, meta: dict | None, base: tuple[int, int] | None) -> list[tuple] | None:
    """A host tensor descriptor's parameters as Triton 3.6's launcher passes them (driver.py, make_tensordesc_arg):
    the tensor map as (offset, source, encoding) for native.cpp to encode at each replay (a base outside per_call:
    its address, -1), then the shape as i32 and the strides as i64; None where the launcher would lower it otherwise
    (no metadata: the kernel takes pointers) or pack it (fp4)."""
    try:
        from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST
    except ImportError:
        return None
    if (meta is None or meta.get("fp4_padded") or not hasattr(descriptor, "block_shape")
            or getattr(descriptor, "round_f32_to_tf32", False)):
        return None
    shape, strides = [int(size) for size in descriptor.shape], [int(stride) for stride in descriptor.strides]
    if strides[-1] != 1 or len(shape) > 5:
        return None
    offset, source = base if base is not None else (descriptor.base.data_ptr(), -1)
    encoding = (TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]], meta["swizzle"], meta["elem_size"],
                1 if descriptor.padding == "nan" else 0, tuple(int(b) for b in meta["block_size"]), tuple(shape),
                tuple(strides))
    return ([(offset, source, encoding)] + [_param_bits("i32", size) for size in shape]
            + [_param_bits("i64", stride) for stride in strides])


def tensors_key(tensors: Sequence[torch.Tensor]) -> tuple:
    """The part of a plan's key that the tensors give: each one's device, shape, strides, dtype and address modulo 16
    (what Triton specializes a kernel on, and what the offsets a plan substitutes depend on; the device, because a
    replay passes addresses that Triton's launcher would have refused to take from a CPU tensor)."""
    return tuple((t.device, t.shape, t.stride(), t.dtype, t.data_ptr() % 16) for t in tensors)


_NO_PLAN = object()


class PlanCache:
    """The launch plans of one call site, by the caller's key: what fixes the site's launches (module doc). At most
    `capacity` keys (0: none); the least recently used goes first, with the tensors its plan keeps.

    `call(key, per_call, run)`: the first call of a key runs `run()` inside record_launches and keeps the plan (or
    None when the recording cannot be replayed: that key then always runs `run()`); later calls replay it with
    per_call's addresses. run() makes the site's launches and returns the tensors the plan may keep reading
    (LaunchPlan's `stable`), an empty tuple when it reads only per_call."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.plans: dict[tuple, LaunchPlan | None] = {}  # ordered by use, the most recent last
        self._lock = threading.Lock()  # the autograd engine's device threads launch too
        self.generation = 0  # clear() calls so far: a key for plans kept elsewhere (the native path's)

    def clear(self) -> None:
        with self._lock:
            self.plans.clear()
            self.generation += 1

    def call(self, key: tuple, per_call: Sequence[torch.Tensor], run) -> None:
        capacity = self.capacity  # once: another thread may change it during the call
        if capacity <= 0:
            run()
            return
        with self._lock:
            found = self.plans.pop(key, _NO_PLAN)
        if found is None:
            run()
        elif found is _NO_PLAN:
            with record_launches() as recording:
                stable = run()
            found = LaunchPlan.build(recording, per_call, stable)
        else:
            found.launch(per_call)
        with self._lock:
            while len(self.plans) >= capacity:
                self.plans.pop(next(iter(self.plans)))
            self.plans[key] = found
