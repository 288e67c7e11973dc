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
still runs; a forward cut short is committed when the worker exits.

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
from rl.vllm.options import selected_ops, trace_base, trace_rate
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
    """A mok.hooks observer that records into this process's trace file, opened on first use."""

    def __init__(self, base: str):
        self.path = trace_path_for_process(base, os.getpid())
        self.rate = trace_rate()  # read now: a bad value fails when the model is built, not mid-generation
        self._recorder = None
        self._pending = 0
        self._closing: set[tuple[str, str]] = set()
        self.meta: dict[str, object] = {"side": "sampler", "pid": os.getpid(), "vllm": vllm_version(),
                                        "ops": sorted(selected_ops()),
                                        "aligned_ops": list(trace_names.per_row_globs()),
                                        "execution_contract": _execution_contract()}

    def close_forward_after(self, name: str, kind: str = "output") -> None:
        """Commit the step after (name, kind) is recorded: that op ends a model forward."""
        self._closing.add((name, kind))

    def forget_closing(self, name: str, kind: str = "output") -> None:
        self._closing.discard((name, kind))

    def _open(self):
        from verify import Recorder

        self.path.parent.mkdir(parents=True, exist_ok=True)
        base, attempt = self.path, 0
        while self.path.exists():  # a file left by an earlier process with the same pid: keep it
            attempt += 1
            self.path = base.with_name(f"{base.stem}-{attempt}{base.suffix}")
        return Recorder(str(self.path), run="vllm", meta=dict(self.meta), **self.rate)

    def __call__(self, name: str, tensor: torch.Tensor, kind: str) -> None:
        if self._recorder is None:
            self._recorder = self._open()
        self._recorder.record(name, tensor, kind=kind)
        self._pending += 1
        if (name, kind) in self._closing:
            self.commit()

    def commit(self) -> None:
        # A forward the rate skips is committed too: that advances the recorder's step count, writing nothing.
        if self._recorder is not None and self._pending:
            self._recorder.step(param_grads=False)
            self._pending = 0

    def close(self) -> None:
        if self._recorder is not None:
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
    # vLLM's workers are multiprocessing children, which skip atexit; their finalizers still run.
    atexit.register(_tracer.close)
    try:
        from multiprocessing import util

        util.Finalize(_tracer, _tracer.close, exitpriority=10)
    except Exception:  # pragma: no cover - atexit still covers ordinary processes
        pass
    return _tracer
