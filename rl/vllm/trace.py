"""Recording in vLLM's worker processes (MOK_TRACE=path).

Each worker process writes its own SQLite trace through `verify.Recorder`: MOK_TRACE=/d/sampler.db
gives /d/sampler.<pid>.db (a directory, or a path ending in '/', gives <dir>/vllm.<pid>.db), so no two
processes share a file. `trace_files(base)` lists them. The recorder observes mok's ops through
`mok.hooks` (the trainer's names, rl/trace_names.py), so nothing is recorded and nothing is computed
for recording when MOK_TRACE is unset. The trace's metadata names its per-row ops (`aligned_ops`), which
`mok-verify report` aligns by content, and holds the worker's execution contract (`execution_contract`,
rl/vllm/contract.py), which `mok-verify diff` compares with the trainer's.

Steps: one step per model forward. The op that ends a forward (the last MoE layer, or lm_head and
logprobs when mok runs those) commits the step, so a finished generate() is on disk while the engine
still runs; a forward cut short is committed when the worker exits. With MOK_TRACE_BACKGROUND=1 the commit hands
the step to the recorder's writer process instead (verify/recorder.py): the forward waits neither for the device nor
for SQLite, and a finished generate() is on disk once that process has written it (before the next recorded forward
is taken, and at the latest when the worker exits).

Rate: MOK_TRACE_EVERY=N records forwards 0, N, 2N, ... of each worker (the others are counted, not
hashed), MOK_TRACE_ROW_EVERY=M keeps the row digests of about one row in M, chosen by content so the
trainer's trace with the same M keeps the same tokens (verify/sampling.py). Both are stored in the trace.
"""
from __future__ import annotations

import atexit
import os
from pathlib import Path

import torch

from mok import hooks
from rl import trace_names
from rl.vllm import vllm_internals
from rl.vllm.options import selected_ops, trace_background, trace_base, trace_rate, trace_ring
from rl.vllm.versions import vllm_version

_tracer: WorkerTracer | None = None


def _trace_layout(base: str | os.PathLike) -> tuple[Path, str, str]:
    """MOK_TRACE=`base` -> (directory, stem, suffix) of its per-process files `<stem>.<pid><suffix>`.

    A directory (or a path ending in the separator) holds `vllm.<pid>.db`; a file path `d/name.ext`
    gives `d/name.<pid>.ext` (no extension: `.db`).
    """
    text = os.fspath(base)
    path = Path(text)
    if text.endswith(os.sep) or path.is_dir():
        return path, "vllm", ".db"
    return path.parent, (path.stem if path.suffix else path.name), (path.suffix or ".db")


def trace_path_for_process(base: str | os.PathLike, pid: int) -> Path:
    """The trace file of process `pid` for MOK_TRACE=`base`."""
    directory, stem, suffix = _trace_layout(base)
    return directory / f"{stem}.{pid}{suffix}"


def trace_files(base: str | os.PathLike) -> list[Path]:
    """Every worker trace written for MOK_TRACE=`base` (`<stem>.<pid>[-n]<suffix>`), sorted by name."""
    directory, stem, suffix = _trace_layout(base)
    return sorted(p for p in directory.glob(f"{stem}.*{suffix}")
                  if p.name[len(stem) + 1:-len(suffix)].split("-")[0].isdigit())


class WorkerTracer:
    """This process's trace: a verify.Recorder and its DeviceTap on the worker's device (verify/capture.py), so that
    recording works the same in eager, compiled and CUDA-graph execution. mok.hooks observes the tracer, whose
    call is the tap's one custom op (nothing else for dynamo to trace, nothing a CUDA graph would skip)."""

    def __init__(self, base: str):
        from verify import Recorder

        self.rate = trace_rate()  # read now: a bad value fails when the model is built, not mid-generation
        background = trace_background()
        self.meta: dict[str, object] = {"side": "sampler", "pid": os.getpid(), "vllm": vllm_version(),
                                        "ops": sorted(selected_ops()),
                                        "aligned_ops": list(trace_names.per_row_globs()),
                                        "execution_contract": _execution_contract()}
        self.path = trace_path_for_process(base, os.getpid())
        self.path.parent.mkdir(parents=True, exist_ok=True)
        first, attempt = self.path, 0
        while self.path.exists():  # a file left by an earlier process with the same pid: keep it
            attempt += 1
            self.path = first.with_name(f"{first.stem}-{attempt}{first.suffix}")
        self._recorder = Recorder(str(self.path), run="vllm", meta=dict(self.meta), background=background,
                                  **self.rate)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self._tap = self._recorder.capture(device, trace_ring() or engine_ring_entries())
        self._tap.on_entry = self._after_entry
        self._closing: set[tuple[str, str]] = set()
        self._serving = False  # a forward of served requests has begun (what ran before was warm-up and capture)
        self._forward_open = False

    def close_forward_after(self, name: str, kind: str = "output") -> None:
        """Commit the step after (name, kind) is recorded from Python: that op ends a model forward. (In a CUDA
        graph it records without Python; the next forward's start commits then, `begin_forward`.)"""
        self._closing.add((name, kind))

    def forget_closing(self, name: str, kind: str = "output") -> None:
        self._closing.discard((name, kind))

    def __call__(self, name: str, tensor: torch.Tensor, kind: str) -> None:
        self._tap(name, tensor, kind)

    def _after_entry(self, name: str, kind: str) -> None:
        # Before the first served forward (warm-up and compile runs, which vLLM starts without its runner's forward
        # hook) the records stay in the ring, which that forward's begin_forward drops.
        if (name, kind) in self._closing and self._serving:
            self.commit()

    def begin_forward(self) -> None:
        """Called before each model forward of vLLM's runner: the first drops what the engine's warm-up and graph
        captures recorded; later ones commit the forward before, when its last op did not (it ran in a graph)."""
        if self._recorder is None:
            return
        if not self._serving:
            self._tap.discard()
            self._serving = True
        elif self._forward_open:
            self.commit()
        self._forward_open = True

    def commit(self) -> None:
        # A forward the rate skips is committed too: that advances the recorder's step count, writing nothing.
        self._forward_open = False
        if self._recorder is not None:
            self._recorder.step(param_grads=False)

    def close(self) -> None:
        if self._recorder is not None:
            if self._forward_open or self._tap.holds_entries():
                self.commit()
            recorder, self._recorder = self._recorder, None
            recorder.close()


def _execution_contract() -> dict[str, object]:
    """This worker's execution contract (rl/vllm/contract.py; `rl.contract.comparable`: without the vLLM keys,
    which the metadata holds as `vllm` and `ops`) while vLLM builds the model; on failure a
    dict naming the error, which `rl.check_contract` / `mok-verify diff` then report as a mismatch."""
    try:
        from rl.contract import comparable
        from rl.vllm.contract import worker_contract

        return comparable(worker_contract())
    except Exception as error:  # noqa: BLE001 - tracing must not stop the engine
        return {"error": f"{type(error).__name__}: {error}"}


def ring_entries(tokens: int, layers: int) -> int:
    """Ring entries (verify/capture.py) for forwards of up to `tokens` tokens through `layers` decoder layers: each
    traced op records one entry per token row and a header of at most 8 (rl/trace_names.py: 13 row records a
    layer at most, and 6 outside the layers), times 2 of headroom. Grows with both: 61 layers at 65536 tokens is about
    840 MB of GPU memory (twice that with MOK_TRACE_BACKGROUND=1); MOK_TRACE_RING sets it instead."""
    records = 13 * layers + 6
    return 2 * records * (tokens + 8)


def engine_ring_entries() -> int | None:
    """The ring for the engine being built: ring_entries(max_num_batched_tokens, num_hidden_layers), so that a
    forward at the engine's own token limit never overflows it; None (verify's default) outside an engine build
    or when it would be smaller than that default."""
    from verify.capture import DEFAULT_CAPACITY

    config = vllm_internals.current_vllm_config()
    tokens = getattr(getattr(config, "scheduler_config", None), "max_num_batched_tokens", None)
    layers = getattr(getattr(getattr(config, "model_config", None), "hf_config", None), "num_hidden_layers", None)
    if not isinstance(tokens, int) or not isinstance(layers, int):
        return None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    entries = ring_entries(tokens, layers)
    return entries if entries > DEFAULT_CAPACITY[device] else None


def worker_tracer() -> WorkerTracer | None:
    """This process's tracer when MOK_TRACE is set (created and attached to mok.hooks once), else None.

    Called by the plugin's layers when vLLM builds the model, i.e. only in processes that run it.
    """
    global _tracer
    if _tracer is not None:
        return _tracer
    base = trace_base()
    if base is None:
        return None
    _tracer = WorkerTracer(base)
    hooks.observe(_tracer)
    vllm_internals.before_each_forward(_tracer.begin_forward)
    # vLLM's workers are multiprocessing children, which skip atexit; their finalizers still run.
    atexit.register(_tracer.close)
    try:
        from multiprocessing import util

        util.Finalize(_tracer, _tracer.close, exitpriority=10)
    except Exception:  # pragma: no cover - atexit still covers ordinary processes
        pass
    return _tracer
