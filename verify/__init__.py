"""verify: fingerprints, traces, trace and checkpoint comparison, bisection. Knows nothing of mok or rl.

Public API (imported lazily, so `import verify` stays cheap):
- `fingerprint(tensor) -> str`, `row_fingerprints(tensor) -> uint64 [R]`      (verify.fingerprints)
- `Recorder(path, run=..., meta=...)`, `Trace(path)`                          (verify.recorder, verify.store)
  `CONTRACT_KEY` = "execution_contract": the metadata key compared first by `diff_traces`  (verify.store)
- `diff_traces(a, b) -> TraceDiff`, `align_by_content(a, b) -> ContentDiff`   (verify.compare)
- `compare_checkpoints(a, b) -> CheckpointDiff`, `hash_checkpoint(path) -> dict` (verify.checkpoint)
- `bisect(repo, good, bad, cmd, output=None, timeout=None) -> BisectResult`   (verify.bisect)
- errors: `VerifyError` and its subclasses                                     (verify.errors)
"""
from __future__ import annotations

import importlib

from verify.errors import (
    ArgumentError,
    BisectError,
    CheckpointError,
    InputNotFoundError,
    ManifestError,
    RecorderError,
    SchemaVersionError,
    TraceError,
    UnsupportedDtypeError,
    VerifyError,
)

_EXPORTS = {
    "fingerprint": "verify.fingerprints",
    "row_fingerprints": "verify.fingerprints",
    "Recorder": "verify.recorder",
    "Trace": "verify.store",
    "CONTRACT_KEY": "verify.store",
    "diff_traces": "verify.compare",
    "align_by_content": "verify.compare",
    "compare_checkpoints": "verify.checkpoint",
    "hash_checkpoint": "verify.checkpoint",
    "bisect": "verify.bisect",
}

__all__ = [
    "VerifyError", "ArgumentError", "InputNotFoundError", "UnsupportedDtypeError", "TraceError", "SchemaVersionError",
    "CheckpointError", "ManifestError", "BisectError", "RecorderError", *_EXPORTS,
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'verify' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
