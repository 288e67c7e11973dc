"""Recorder: fingerprints of module inputs, outputs and gradients, and of any named tensor, per step.

What is recorded, in execution order (seq) inside each step:
  phase forward         kind input   a selected module's tensor inputs (forward pre-hook, so in-place
                                     changes made by the forward do not leak into them)
                        kind output  its tensor outputs (forward hook)
  phase backward        kind grad    `<module>.grad_output` (full backward pre-hook) and
                                     `<module>.grad_input` (full backward hook): gradients flowing back
  phase after_backward  kind param   `.grad` of the selected modules' own parameters, recorded by
                                     `step()`: call it after backward and before `zero_grad()`
A module's first tensor is recorded under the module's name, further ones as `name[i]` (i = position
in the flattened args/kwargs or outputs), so an op's main input and output share its name — which is
what content alignment pairs. Direct `record(name, tensor, kind)` calls interleave with hooks in call
order. On CUDA the row digests are computed on the device without synchronising; `step()` moves all
of a step's digests to the host at once and commits the step in one transaction.

Rate (verify/sampling.py): `every=N` records steps 0, N, 2N, ... (the hooks of other steps return at
once); `row_every=M` keeps the row digests of about one row in M, chosen by content. The setting is
stored in the trace; the whole-tensor digest of a recorded tensor always covers all its rows.

Background writing (`background=True`): `step()` enqueues the copy of the step's digests and hands the step to a
thread that waits for the copy and sends the host arrays to the recorder's writer process
(verify/writer_process.py), which builds the records and commits them while the caller's next step runs. On a GPU
`step()` then never waits for the device, and the caller's interpreter never builds records or runs SQLite. One
step is written at a time (the next `step()` waits for it), so memory stays bounded and a write error surfaces at
the next `step()`, `flush()` or `close()`. A kill then loses at most the step being written and the one in flight.
"""
from __future__ import annotations

import fnmatch
import os
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from verify.args import as_flag
from verify.capture import DeviceTap, RingWords, site_keys, to_host_later
from verify.errors import RecorderError
from verify.fingerprints import row_digests_async
from verify.sampling import name_selector, setting
from verify.step_records import DEFAULT_PHASE, PendingRecord, StepData, commit_step
from verify.store import KINDS, PHASES
from verify.trace_writer import TraceWriter
from verify.writer_process import WriterProcess

Pattern = str | re.Pattern


class _Attachment:
    """Hooks on the selected modules of one `attach` call; `remove()` takes them off."""

    def __init__(self, modules: list[tuple[str, torch.nn.Module]]):
        self.modules = modules
        self.handles: list = []

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _matches(name: str, patterns: Sequence[Pattern]) -> bool:
    for pattern in patterns:
        if isinstance(pattern, re.Pattern):
            if pattern.fullmatch(name):
                return True
        elif pattern.startswith("re:"):
            if re.fullmatch(pattern[3:], name):
                return True
        elif fnmatch.fnmatchcase(name, pattern):
            return True
    return False


def _tensor_leaves(value, path: str = "") -> Iterable[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor in nested tuples/lists/dicts, in order; other leaves are skipped."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensor_leaves(item, f"{path}[{key}]")
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from _tensor_leaves(item, f"{path}[{i}]")


class Recorder:
    """Records fingerprints into a trace file (SQLite), one committed transaction per step.

    path: the trace file to create (refuses to replace an existing one unless overwrite=True). The
    recorder holds the trace's writer lock (`<path>.lock`) until close(): a second Recorder on the same
    path, in this process or another, raises RecorderError.
    run: a name for the run; meta: JSON-serialisable metadata (config, seed, revision...); its key
    "execution_contract" (verify.CONTRACT_KEY), a flat dict of what decides the bits, is compared
    first by `diff_traces`.
    rows: default for storing per-row digests (needed to say which rows differ and to align by content).
    every: record only steps whose index is a multiple of it (others cost nothing); row_every: keep the
    row digests of about one row in it, chosen by content (verify/sampling.py says why). Both positive
    ints (RecorderError otherwise). names: record only the names matching these globs (None: every name;
    a capture tap then appends nothing for the others, and a CUDA graph holds no kernel for them). All three
    are stored in the trace's "sampling" run key.
    background: commit each step in a writer process while the next step runs (the module docstring says
    what a crash may then lose); `flush()` waits until every step handed over is committed.

        with verify.Recorder("run.db", run="trainer", meta={"seed": 0}) as rec:
            rec.attach(model, include=["*.mlp", "re:layers\\.\\d+\\.self_attn"])
            for batch in data:
                model(batch).loss.backward()
                rec.step()          # records parameter gradients, then commits the step
                opt.step(); opt.zero_grad()
    """

    def __init__(self, path: str | os.PathLike, run: str = "run", meta: dict | None = None, *,
                 rows: bool = True, overwrite: bool = False, every: int = 1, row_every: int = 1,
                 names: str | Sequence[str] | None = None, background: bool = False):
        rows = as_flag(rows, "rows", RecorderError)
        background = as_flag(background, "background", RecorderError)
        self.sampling = setting(every, row_every, RecorderError, names=names)
        self.every, self.row_every = self.sampling["every"], self.sampling["row_every"]
        self.selects: Callable[[str], bool] = name_selector(self.sampling)
        """Whether the rate's names record a name (every name when names is None)."""
        writer = WriterProcess if background else TraceWriter
        self._writer = writer(path, run, meta, overwrite=overwrite, sampling=self.sampling)
        self.path = self._writer.path
        self.rows = rows
        self._step = 0
        self._seq = 0
        self._pending: list[tuple[PendingRecord, torch.Tensor]] = []  # digests int64 [R] on the device
        self._attachments: list[_Attachment] = []
        self._taps: list[DeviceTap] = []
        self._lock = threading.Lock()
        self._closed = False
        self._background = ThreadPoolExecutor(1, thread_name_prefix="verify-writer") if background else None
        self._in_write: Future | None = None

    # -- recording ---------------------------------------------------------------------------------
    @property
    def current_step(self) -> int:
        """The step that records go to now (0-based); `step()` commits it and moves on."""
        return self._step

    @property
    def recording(self) -> bool:
        """Whether the current step is recorded (its index is a multiple of `every`)."""
        return self._step % self.every == 0

    def record(self, name: str, tensor: torch.Tensor, kind: str = "output", rows: bool | None = None,
               phase: str | None = None) -> None:
        """Record one named tensor (any shape, any supported dtype, CPU or CUDA).

        kind: input | output | grad | param; phase defaults from kind (forward, backward, after_backward).
        Signature-compatible with mok.hooks observers: observe(lambda n, t, k: rec.record(n, t, kind=k)).
        """
        if self._closed:
            raise RecorderError(f"recorder for {self.path} is closed")
        if self._step % self.every:  # a step the rate skips: nothing is checked or computed
            return
        if not isinstance(name, str):
            raise RecorderError(f"record: name must be a str, got {name!r}")
        if not self.selects(name):
            return
        rows = as_flag(rows, "record: rows", RecorderError, optional=True)
        if not isinstance(kind, str) or kind not in KINDS:
            raise RecorderError(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
        phase = phase or DEFAULT_PHASE[kind]
        if not isinstance(phase, str) or phase not in PHASES:
            raise RecorderError(f"unknown phase {phase!r}; expected one of {', '.join(PHASES)}")
        if not isinstance(tensor, torch.Tensor):
            raise RecorderError(f"record({name!r}) needs a tensor, got {type(tensor).__name__}")
        digests_R = row_digests_async(tensor)
        with self._lock:
            self._pending.append((PendingRecord(self._seq, phase, name, kind, tensor.dtype, tuple(tensor.shape),
                                                self.rows if rows is None else rows), digests_R))
            self._seq += 1

    def capture(self, device: torch.device | str, capacity: int | None = None) -> DeviceTap:
        """An observer for compiled and captured code (torch.compile, CUDA graphs; verify/capture.py): attach it
        with `mok.hooks.observe(...)`; each `step()` harvests what it recorded, after the direct records, in
        execution order. device: where the observed tensors live (one tap per device); capacity: ring entries
        (int64) per step, verify.capture.DEFAULT_CAPACITY by default. A step that overflows the ring is
        committed as lost, and readers refuse the trace (TraceError)."""
        if self._closed:
            raise RecorderError(f"recorder for {self.path} is closed")
        tap = DeviceTap(device, capacity, background=self._background is not None)
        tap.enabled = self.recording
        tap.selects = self.selects  # a function of the setting alone: the tap holds no reference to the recorder
        self._taps.append(tap)
        return tap

    def _record_tree(self, name: str, value, kind: str, phase: str) -> None:
        if self._step % self.every:  # skipped step: do not even walk the hook's arguments
            return
        for i, (path, tensor) in enumerate(_tensor_leaves(value)):
            self.record(name if i == 0 else f"{name}{path}", tensor, kind=kind, phase=phase)

    # -- modules -----------------------------------------------------------------------------------
    def attach(self, module: torch.nn.Module, include: Pattern | Sequence[Pattern] | None = None,
               types: type | tuple[type, ...] | None = None, *, forward: bool = True, backward: bool = True,
               params: bool = True) -> _Attachment:
        """Hook the selected submodules of `module`; returns a handle with `.remove()`.

        include: module-name patterns — globs (fnmatch, '*' crosses dots) or regexes (re.Pattern or a
        're:' prefix), full match; None selects every submodule except the root ('' — select it with '*').
        types: module classes (isinstance); None accepts any. A module is selected if both agree.
        forward / backward / params: record inputs+outputs / gradients flowing back / parameter grads.
        """
        if not isinstance(module, torch.nn.Module):
            raise RecorderError(f"attach needs a torch.nn.Module, got {type(module).__name__}")
        if isinstance(include, (str, re.Pattern)):
            include = [include]
        if include is not None:
            if not isinstance(include, Sequence) or not all(isinstance(p, (str, re.Pattern)) for p in include):
                raise RecorderError(f"attach: include must be a glob, a regex or a list of them, got {include!r}")
            for pattern in include:
                if isinstance(pattern, str) and pattern.startswith("re:"):
                    try:
                        re.compile(pattern[3:])
                    except re.error as e:
                        raise RecorderError(f"attach: include {pattern!r} is not a valid regex ({e})") from None
        if types is not None and not (isinstance(types, type) or (
                isinstance(types, tuple) and types and all(isinstance(t, type) for t in types))):
            raise RecorderError(f"attach: types must be a class or a tuple of classes, got {types!r}")
        selected = [
            (name, mod) for name, mod in module.named_modules()
            if (_matches(name, include) if include is not None else name != "")
            and (types is None or isinstance(mod, types))
        ]
        if not selected:
            raise RecorderError(f"attach selected no module of {type(module).__name__} "
                                f"(include={include}, types={types})")
        attachment = _Attachment(selected if params else [])
        for name, mod in selected:
            if forward:
                attachment.handles.append(mod.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True))
                attachment.handles.append(mod.register_forward_hook(self._post_hook(name)))
            if backward:
                attachment.handles.append(mod.register_full_backward_pre_hook(self._grad_output_hook(name)))
                attachment.handles.append(mod.register_full_backward_hook(self._grad_input_hook(name)))
        self._attachments.append(attachment)
        return attachment

    def _pre_hook(self, name: str):
        def hook(mod, args, kwargs):
            self._record_tree(name, (args, kwargs) if kwargs else args, "input", "forward")
        return hook

    def _post_hook(self, name: str):
        def hook(mod, args, output):
            self._record_tree(name, output, "output", "forward")
        return hook

    def _grad_output_hook(self, name: str):
        def hook(mod, grad_output):
            self._record_tree(f"{name}.grad_output", grad_output, "grad", "backward")
        return hook

    def _grad_input_hook(self, name: str):
        def hook(mod, grad_input, grad_output):
            self._record_tree(f"{name}.grad_input", grad_input, "grad", "backward")
        return hook

    def record_param_grads(self) -> int:
        """Record `.grad` of the attached modules' own parameters (kind param); returns how many."""
        seen: set[int] = set()
        count = 0
        if not self.recording:
            return 0
        for attachment in self._attachments:
            for mod_name, mod in attachment.modules:
                for p_name, param in mod.named_parameters(recurse=False):
                    if param.grad is None or id(param) in seen:
                        continue
                    seen.add(id(param))
                    self.record(f"{mod_name}.{p_name}" if mod_name else p_name, param.grad, kind="param")
                    count += 1
        return count

    # -- commit ------------------------------------------------------------------------------------
    def step(self, param_grads: bool = True) -> int:
        """Record parameter gradients (unless param_grads=False), commit the step; returns its index."""
        if param_grads:
            self.record_param_grads()
        return self._commit(complete=True)

    def _take_later(self) -> list[Callable[[], RingWords]]:
        """What the capture taps recorded since the last step, one function per tap that gives its words.
        background: taken without waiting for the device (the write's thread waits; verify/capture.py,
        DeviceTap.take_later); otherwise taken now, copying only each ring's written prefix."""
        if self._background is None:
            return [_ready(tap.take()) for tap in self._taps]
        return [tap.take_later() for tap in self._taps]

    def _commit(self, complete: bool, takes: list[Callable[[], RingWords]] | None = None,
                inline: bool = False) -> int:
        skipped = self._step % self.every != 0
        with self._lock:
            pending, self._pending = self._pending, []
            step, self._step, self._seq = self._step, self._step + 1, 0
        try:
            if skipped:  # what a CUDA graph's replay hashed is dropped without reading the ring (no device sync)
                for tap in self._taps:
                    tap.discard()
            elif takes is None:
                try:
                    self.flush()  # the taps' staging rings are free again once the previous write has finished
                except BaseException:  # the previous write failed: this step is lost with it, as its records are
                    for tap in self._taps:
                        tap.discard()
                    raise
                takes = self._take_later()
        finally:
            for tap in self._taps:
                tap.enabled = self.recording
        if skipped:
            return step  # a skipped step leaves nothing in the trace
        records = [record for record, _ in pending]
        digests = _to_host_later([digests_R for _, digests_R in pending])
        self._write(lambda: self._commit_data(StepData(
            step, records, [d.numpy() for d in digests()], [take() for take in takes], site_keys(), self.rows,
            self.row_every, complete)), inline)
        return step

    def _commit_data(self, data: StepData) -> None:
        """Commit a step whose digests are on the host: in the writer process (background), else here."""
        if isinstance(self._writer, WriterProcess):
            self._writer.commit(data)
        else:
            commit_step(self._writer, data)

    def _write(self, job: Callable[[], None], inline: bool = False) -> None:
        """Run a step's write now (inline, or without background), or on the write's thread; either way once the
        previous write has finished."""
        self.flush()
        if self._background is None or inline:
            job()
            return
        try:
            self._in_write = self._background.submit(job)
        except RuntimeError:  # interpreter exit (e.g. a step taken in an atexit hook): the pool takes no more work
            job()

    def flush(self) -> None:
        """Wait until every step handed to the writer process is committed (background=True; otherwise every
        step() has committed already). Re-raises the error of a failed write."""
        in_write, self._in_write = self._in_write, None
        if in_write is not None:
            in_write.result()

    def close(self, complete: bool = True) -> None:
        """Commit records made since the last step (if any), remove hooks, close the file.

        Raises RecorderError, after closing everything, when a reader held an older snapshot past
        verify.trace_writer.CLOSE_WAIT_S (the .db alone then lacks the latest steps; the -wal has them)."""
        if self._closed:
            return
        try:
            self.flush()
            taken = [tap.take() for tap in self._taps]
            if self._pending or any(ring.cursor for ring in taken):
                # sent from here: at interpreter exit (an atexit close) the thread pool takes no more work
                self._commit(complete, [_ready(ring) for ring in taken], inline=True)
        finally:
            self._closed = True
            for attachment in self._attachments:
                attachment.remove()
            try:
                self.flush()
            finally:
                if self._background is not None:
                    self._background.shutdown()
                self._writer.close()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # On an exception the records of the step in flight are kept, marked incomplete.
        self.close(complete=exc_type is None)


def _ready(value):
    return lambda: value


def _to_host_later(digests: list[torch.Tensor]) -> Callable[[], list[torch.Tensor]]:
    """Many small digest tensors to the host, one copy per device, enqueued now (verify/capture.py,
    to_host_later); the returned function waits for them."""
    by_device: dict[torch.device, list[int]] = {}
    for i, d in enumerate(digests):
        by_device.setdefault(d.device, []).append(i)
    copies = [(idx, to_host_later(torch.cat([digests[i] for i in idx]))) for device, idx in by_device.items()]

    def wait() -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(digests)
        for idx, copy in copies:
            for i, part in zip(idx, copy().split([digests[i].numel() for i in idx])):
                out[i] = part
        return out

    return wait
