"""The rate setting of a trace: which steps and which rows' digests a Recorder keeps.

    every      record steps whose index is a multiple of `every` (step 0, every, 2*every, ...); the
               other steps cost nothing (the recorder's hooks return at once) and leave no row in the
               trace. Step indices stay the caller's, so two traces with different settings share them.
    row_every  keep the per-row digests of about one row in `row_every`, chosen by content (ROW_RULE).
               The whole-tensor digest still covers every row: it is computed from all row digests,
               which the recorder computes anyway, so a change in any row of a recorded step is caught
               by `diff`; only which rows are named (and which rows content alignment pairs) is sampled.
    names      record only the names matching these globs (fnmatch; default: every name). A name left out
               costs nothing: nothing is hashed, and a CUDA graph captured with a tap holds no kernel for it.
               A divergence still shows at the next recorded name downstream (a decoder layer's input norm
               reads the residual stream that every op of the layer before wrote), at a fraction of the cost.

Why by content, not by position: a trainer and a sampler batch the same tokens differently (packed
sequences vs prefill and decode steps), so a rule of (step, row index) would keep different tokens on
the two sides and `diff --align content` would pair almost nothing. A rule of the row's own digest keeps
a token's row wherever it occurs, on both sides, with the same setting; an op's output rows follow its
input's choice, so the (input row, output row) pairs that alignment compares survive sampling.

Stored in the trace's run table (key "sampling", JSON {"every", "row_every", "rule"}, and "names" when set); a
trace without it was recorded whole. With row_every > 1 each record's `rows` BLOB holds the kept row indices
(little-endian uint64), then their digests: verify.store.Record.row_indices / row_digests.
"""
from __future__ import annotations

import fnmatch
import json
import numbers
from collections.abc import Callable

import numpy as np

from verify.errors import ArgumentError, TraceError, VerifyError

SAMPLING_KEY = "sampling"
ROW_RULE = ("row kept when its key digest mod row_every == 0; key: for an output record following an input "
            "record of the same name, step and row count, that input's row, else the row itself")
WHOLE = {"every": 1, "row_every": 1}


def as_rate(value, label: str, error: type[VerifyError] = ArgumentError) -> int:
    """A positive int (not a bool, not a float): one setting of the rate."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        raise error(f"{label} must be a positive int (1 = every one), got {value!r}")
    return int(value)


def setting(every, row_every, error: type[VerifyError] = ArgumentError, names=None) -> dict:
    """The stored form of a rate setting, values checked (names: None, a glob or a non-empty list of globs)."""
    value = {"every": as_rate(every, "every", error), "row_every": as_rate(row_every, "row_every", error),
             "rule": ROW_RULE}
    if names is not None:
        value["names"] = as_names(names, error)
    return value


def as_names(value, error: type[VerifyError] = ArgumentError) -> list[str]:
    """A glob or a non-empty list of globs (str) -> a list."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) and n for n in names):
        raise error(f"names must be a glob or a non-empty list of globs (str), got {value!r}")
    return list(names)


def records_name(value: dict, name: str) -> bool:
    """Whether a trace with this setting records `name`."""
    names = value.get("names")
    return names is None or any(fnmatch.fnmatchcase(name, glob) for glob in names)


def name_selector(value: dict) -> Callable[[str], bool]:
    """records_name for one setting, remembered per name (a recorder asks for the same few hundred names at every
    step)."""
    selected: dict[str, bool] = {}

    def selects(name: str) -> bool:
        answer = selected.get(name)
        if answer is None:
            answer = selected[name] = records_name(value, name)
        return answer

    return selects


def read_setting(text: str | None, path) -> dict:
    """The setting stored in a trace's run table (None: recorded whole); TraceError when malformed."""
    if text is None:
        return dict(WHOLE)
    try:
        value = json.loads(text)
        read = {"every": as_rate(value["every"], "every", TraceError),
                "row_every": as_rate(value["row_every"], "row_every", TraceError), "rule": value.get("rule")}
        if value.get("names") is not None:
            read["names"] = as_names(value["names"], TraceError)
        return read
    except (TypeError, ValueError, KeyError, TraceError) as e:
        raise TraceError(f"{path} is a corrupt verify trace: its sampling setting {text!r} is malformed ({e})"
                         ) from None


def describe(value: dict) -> str:
    steps = "every step" if value["every"] == 1 else f"every {value['every']} steps"
    rows = "all rows" if value["row_every"] == 1 else f"1 row in {value['row_every']} by content"
    names = "" if value.get("names") is None else f", names {','.join(value['names'])}"
    return f"{steps}, {rows}{names}"


def records_step(value: dict, step: int) -> bool:
    return step % value["every"] == 0


def keep_rows(key_digests: np.ndarray, row_every: int) -> np.ndarray:
    """Indices of the rows kept for these key digests (int64 or uint64 [R])."""
    return np.flatnonzero(key_digests.view("<u8") % np.uint64(row_every) == 0)


def common_rows(index_a: np.ndarray | None, rows_a: np.ndarray, index_b: np.ndarray | None,
                rows_b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row indices, A's digests, B's digests) of the rows both records kept; index None = all rows."""
    if index_a is None and index_b is None:
        return np.arange(len(rows_a)), rows_a, rows_b
    ia = np.arange(len(rows_a), dtype="<u8") if index_a is None else index_a
    ib = np.arange(len(rows_b), dtype="<u8") if index_b is None else index_b
    both, at_a, at_b = np.intersect1d(ia, ib, assume_unique=True, return_indices=True)
    return both, rows_a[at_a], rows_b[at_b]


def note(a: dict, b: dict) -> str | None:
    """One line naming both sides' settings when either side is sampled; None when both are whole."""
    if a["every"] == b["every"] == 1 and a["row_every"] == b["row_every"] == 1 and a.get("names") == b.get("names"):
        return None
    return (f"sampling: A {describe(a)}; B {describe(b)}: compared only the steps, names and rows both recorded "
            "(one that a side skipped is not a divergence)")


def filter_steps(records, other: dict):
    """The records of the steps and names that a trace with the setting `other` records too."""
    every = other["every"]
    if other.get("names") is not None:
        selects = name_selector(other)
        records = (r for r in records if selects(r.name))
    return records if every == 1 else (r for r in records if r.step % every == 0)
