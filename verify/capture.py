"""Recording inside compiled and captured execution: torch.compile graphs and CUDA graphs.

An eager observer (`Recorder.record`) hashes each tensor from Python and keeps the digests in a Python list;
neither survives torch.compile (dynamo would trace the bookkeeping, or break the graph on it) nor a CUDA graph
(a replay runs no Python). A `DeviceTap` is an observer that does only one thing per tensor: the custom op
`verify::tap(x, ring, state, name, kind, tap_id)`. torch.compile keeps it as an opaque node (it mutates the
ring) and runs its implementation at run time; a CUDA graph captures its kernels. It appends one entry to a
preallocated int64 ring on x's device, at a cursor that lives on the device too:

    [site, ndim, shape_0 .. shape_{ndim-1}, row digest_0 .. row digest_{R-1}]     (R rows: verify/fingerprints.py)

`site` numbers (name, kind, dtype) in this process, assigned the first time the op runs in Python (eagerly,
while torch.compile's graph runs, or once when a CUDA graph is captured); ndim is at most 6. The row digests are
those of `verify.row_fingerprints`, computed on the device (verify/fingerprints_triton.py). An entry that does
not fit is not written, but the cursor moves past it: `state = [cursor, written, gate, destination]` (the last
a scratch slot of the append), and cursor > written after a step says that records were lost. The gate mirrors
`enabled` on the device: a CUDA graph replays its taps on every step, and on a step the rate skips (gate 0) its
kernels read nothing and append nothing.

The Recorder's `step()` takes the entries after the step's work is enqueued. `take()` waits for the device,
copies the written prefix to the host and resets the cursor; `parse_ring` turns the words back into (name, kind,
dtype, shape, row digests), `harvest()` does both. With `background=True` the Recorder calls `take_later()`
instead: on the device's stream it copies the ring and its counters and resets the cursor, without waiting; a
thread then waits for that copy and brings the written prefix to the host on a stream of its own, while the next
step runs, and the recorder's writer process parses it (verify/writer_process.py). Either way the entries are
committed like eager records; a step that overflowed is committed as lost, and readers refuse such a trace
(verify/store.py).
"""
from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from verify.errors import RecorderError
from verify.fingerprints import row_bits, row_digests_async, row_layout

MAX_NDIM = 6
DEFAULT_CAPACITY = {"cuda": 1 << 24, "cpu": 1 << 22}
"""Ring entries (8 bytes each) by device type: 128 MiB on a GPU holds the rows of about 13 recorded ops per layer
of a 48-layer model at 16k tokens per forward; the CPU's 32 MiB suits the small models it runs."""

_sites: dict[tuple[str, str, torch.dtype], int] = {}
_site_keys: list[tuple[str, str, torch.dtype]] = []
_taps: weakref.WeakValueDictionary[int, DeviceTap] = weakref.WeakValueDictionary()
_tap_ids = itertools.count(1)
_lock = threading.Lock()
_copy_streams: dict[torch.device, torch.cuda.Stream] = {}


def _site(name: str, kind: str, dtype: torch.dtype) -> int:
    key = (name, kind, dtype)
    site = _sites.get(key)
    if site is None:
        with _lock:
            site = _sites.setdefault(key, len(_site_keys))
            if site == len(_site_keys):
                _site_keys.append(key)
    return site


@torch.library.custom_op("verify::tap", mutates_args=("ring", "state"))
def _tap(x: torch.Tensor, ring: torch.Tensor, state: torch.Tensor, name: str, kind: str, tap_id: int) -> None:
    tap = _taps.get(tap_id)
    # A capture records the kernels whatever the step: its replays are gated on the device (state[2]). A name the
    # rate leaves out records nothing, in a capture too: its replays launch nothing for it.
    if (tap is None or tap.enabled or _capturing(ring)) and (tap is None or tap.selects(name)):
        if x.dim() > MAX_NDIM:
            raise RecorderError(f"tap {name!r}: a captured record holds at most {MAX_NDIM} dimensions, got {x.dim()}")
        header = [_site(name, kind, x.dtype), x.dim(), *x.shape]
        if ring.is_cuda:
            from verify.fingerprints_triton import append_row_digests

            bits_RN, key = row_bits(x)
            append_row_digests(ring, state, header, bits_RN.to(ring.device), key)
        else:
            _append_cpu(ring, state, header, row_digests_async(x))
    if tap is not None and tap.on_entry is not None and not _capturing(ring):
        tap.on_entry(name, kind)


@_tap.register_fake
def _tap_fake(x, ring, state, name, kind, tap_id) -> None:
    return None


def to_host_later(tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A function (call it once, from any thread) that returns `tensor` on the host as it is when the work
    enqueued so far on its device's current stream has run; nothing waits now. The copy runs on a stream of its
    own, so it does not queue behind work enqueued later."""
    if tensor.device.type != "cuda":
        return lambda: tensor
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(tensor.device))

    def wait() -> torch.Tensor:
        ready.synchronize()
        return _to_pinned(tensor)

    return wait


def _to_pinned(tensor: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of a CUDA tensor whose producers have finished, made on the device's copy stream."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    with _lock:
        stream = _copy_streams.get(tensor.device)
        if stream is None:
            stream = _copy_streams[tensor.device] = torch.cuda.Stream(tensor.device)
    with torch.cuda.stream(stream):
        host.copy_(tensor, non_blocking=True)
    stream.synchronize()
    return host


def _capturing(ring: torch.Tensor) -> bool:
    return ring.is_cuda and torch.cuda.is_current_stream_capturing()


def _append_cpu(ring: torch.Tensor, state: torch.Tensor, header: list[int], digests_R: torch.Tensor) -> None:
    if int(state[2]) == 0:
        return
    start = int(state[0])
    end = start + len(header) + digests_R.numel()
    if end <= ring.numel():
        ring[start:start + len(header)] = torch.tensor(header, dtype=torch.int64)
        ring[start + len(header):end] = digests_R
        state[1] = end
    state[0] = end


@dataclass
class Entry:
    """One harvested record: what the op emitted, in execution order."""

    name: str
    kind: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    digests_R: torch.Tensor  # int64 [R] on the host


class RingWords(NamedTuple):
    """A tap's ring as taken to the host: the written prefix (int64 [written]) and the counters (cursor > written:
    entries were lost)."""

    words: np.ndarray
    cursor: int
    written: int


def site_keys() -> list[tuple[str, str, torch.dtype]]:
    """(name, kind, dtype) of every site numbered so far in this process, by site number (a snapshot: parse_ring
    in another process needs it)."""
    with _lock:
        return list(_site_keys)


def parse_ring(taken: RingWords, keys: list[tuple[str, str, torch.dtype]]) -> tuple[list[Entry], bool]:
    """(entries in execution order, lost) of a taken ring; keys: site_keys() of the process that recorded it."""
    words, cursor, written = taken
    entries, at = [], 0
    # Indexed through numpy: a recorded forward holds hundreds of entries, and a sampler's engine shares the
    # interpreter with whoever parses them.
    while at < written:
        site, ndim = int(words[at]), int(words[at + 1])
        if not (0 <= site < len(keys) and 0 <= ndim <= MAX_NDIM):
            raise RecorderError(f"capture ring holds a malformed entry at {at} (site {site}, ndim {ndim})")
        shape = tuple(words[at + 2:at + 2 + ndim].tolist())
        rows = row_layout(shape)[0]
        start = at + 2 + ndim
        name, kind, dtype = keys[site]
        entries.append(Entry(name, kind, dtype, shape, torch.from_numpy(words[start:start + rows])))
        at = start + rows
    return entries, cursor != written


class DeviceTap:
    """A mok.hooks observer for compiled and captured code: `observer(name, tensor, kind)` appends the tensor's row
    digests to a ring on `device` (see the module docstring). Get one from `Recorder.capture(device)`, which
    harvests it at each `step()`; attach it with `mok.hooks.observe(tap)` before torch.compile traces or a CUDA
    graph is captured, and keep it (the compiled code and the graphs hold its ring).

    enabled: False makes the op return at once where it runs from Python (eager, torch.compile), and a CUDA
    graph's replay of it read and append nothing (the device gate). selects(name): False for a name the rate
    leaves out (Recorder.selects): nothing is appended for it, and a CUDA graph captures nothing for it.
    on_entry(name, kind): called after each tensor observed from Python outside a CUDA-graph capture, appended or
    not (a sampler commits its step after its last op).
    background: allocate with the ring the staging ring that `harvest_later` copies it into (a Recorder with
    background=True makes its taps so; otherwise the first harvest_later allocates it).
    """

    def __init__(self, device: torch.device | str, capacity: int | None = None, *, background: bool = False):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        capacity = DEFAULT_CAPACITY.get(self.device.type, DEFAULT_CAPACITY["cpu"]) if capacity is None else capacity
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 16:
            raise RecorderError(f"capture capacity must be an int >= 16 (ring entries), got {capacity!r}")
        self.capacity = capacity
        self.ring = torch.zeros(capacity, dtype=torch.int64, device=self.device)
        self.state = torch.tensor([0, 0, 1, -1], dtype=torch.int64, device=self.device)
        # harvest_later's copy of the ring, allocated with it (before an engine sizes its caches by what is free)
        self._staging = torch.empty_like(self.ring) if background and self.device.type == "cuda" else None
        self._staging_busy = False
        self._enabled = True
        self.on_entry: Callable[[str, str], None] | None = None
        self.selects: Callable[[str], bool] = lambda name: True
        self.tap_id = next(_tap_ids)
        _taps[self.tap_id] = self

    def __call__(self, name: str, tensor: torch.Tensor, kind: str) -> None:
        torch.ops.verify.tap(tensor, self.ring, self.state, name, kind, self.tap_id)

    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        if value != self._enabled:
            self._enabled = bool(value)
            self.state[2:3].fill_(int(self._enabled))  # stream-ordered: replays enqueued after it see it

    def holds_entries(self) -> bool:
        """Whether anything was appended since the last harvest (reads the cursor: a device sync)."""
        return int(self.state[0]) > 0

    def discard(self) -> None:
        """Forget what the ring holds (work done before the recorded steps began: warm-up, capture)."""
        self.state[:2].zero_()

    def harvest(self) -> tuple[list[Entry], bool]:
        """(entries in execution order, lost) since the last harvest; resets the ring. lost: some did not fit.
        Waits for the device, then copies only the written prefix."""
        return parse_ring(self.take(), site_keys())

    def harvest_later(self) -> Callable[[], tuple[list[Entry], bool]]:
        """Take the ring's entries and reset it without waiting for the device; the returned function (call it
        once, from any thread, before the next harvest_later) waits for them and returns what harvest() returns."""
        take = self.take_later()
        return lambda: parse_ring(take(), site_keys())

    def take(self) -> RingWords:
        """What the ring holds since the last take, as host words (harvest() parses them); resets the ring.
        Waits for the device, then copies only the written prefix."""
        cursor, written = (int(v) for v in self.state[:2].tolist())
        words = self.ring[:written].to("cpu", copy=True).numpy()  # a copy: the ring is reused at once
        self.state[:2].zero_()
        return RingWords(words, cursor, written)

    def take_later(self) -> Callable[[], RingWords]:
        """take() without waiting for the device: the returned function (call it once, from any thread, before the
        next take_later) waits for the words and returns them.

        On a GPU the ring and its counters are copied on the current stream into a staging ring (a device-to-device
        copy, a few hundredths of a millisecond; allocated with the ring when the tap is made with
        background=True) before the reset, so the work enqueued next appends to an empty ring while the staged
        written prefix goes to the host on a stream of its own."""
        if self.device.type != "cuda":
            taken_now = self.take()
            return lambda: taken_now
        if self._staging_busy:
            raise RecorderError("harvest_later: the previous harvest's entries were not collected yet")
        if self._staging is None:
            self._staging = torch.empty_like(self.ring)
        staging = self._staging
        staging.copy_(self.ring)
        counts = torch.empty(2, dtype=torch.int64, pin_memory=True)
        counts.copy_(self.state[:2], non_blocking=True)
        self.state[:2].zero_()
        taken = torch.cuda.Event()
        taken.record()
        self._staging_busy = True

        def collect() -> RingWords:
            try:
                taken.synchronize()
                cursor, written = (int(v) for v in counts.tolist())
                return RingWords(_to_pinned(staging[:written]).numpy(), cursor, written)
            finally:
                self._staging_busy = False

        return collect

    def __repr__(self) -> str:
        return f"DeviceTap({self.device}, capacity={self.capacity})"
