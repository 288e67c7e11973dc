"""Trace files: SQLite (stdlib sqlite3, WAL), one transaction per step.

Schema (version SCHEMA_VERSION, stored as PRAGMA user_version; PRAGMA application_id marks the file
as a verify trace):
  run(key, value)                         run name, JSON metadata, creation time, writer versions,
                                          closed ('' until the writer's close(), then its time)
  steps(step, n_records, complete, committed_at)
    complete  1; 0 for a step cut short (an exception; its records are kept); LOST (-1) when records of the
              step were lost (a capture ring overflowed, verify/capture.py): readers refuse such a trace
  records(step, seq, phase, name, kind, dtype, shape, digest, rows)
    seq    execution order inside the step, from 0
    phase  forward | backward | after_backward
    kind   input | output | grad | param
    shape  JSON list; digest = verify.fingerprint hex; rows = row digests, little-endian uint64 BLOB
           (in a trace recorded with row_every > 1: the kept row indices, then their digests)
  run key "sampling": the rate setting, verify/sampling.py (absent: every step and row recorded)
A step's records and its `steps` row commit together, so a process killed mid-run leaves every
completed step readable (the .db with its -wal) and loses at most the step in flight. After each commit
the WAL is checkpointed into the main file without waiting, and at close waiting up to CLOSE_WAIT_S for
readers, so the `.db` file alone, copied without its `-wal`, holds every committed step after close(),
and while the writer runs unless a reader outside verify holds an older snapshot (verify's readers read
in short transactions). A writer killed during a checkpoint leaves the `.db` alone inconsistent (pages
are copied in place); readers then raise TraceError naming the -wal it needs. docs/contracts.md,
"Durability", states all of this with the tests that prove it.

One writer per trace: a Recorder resolves the trace's real path (symlinks are written through and
kept) and holds an exclusive lock (`fcntl.flock` on the sidecar file `<real path>.lock`, taken before
anything is replaced, removed at close) for its lifetime; a second Recorder on the same file, in this
process or another, by any spelling, gets a `RecorderError`.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from verify.args import as_int, as_path, as_steps, what_is_at
from verify.errors import ArgumentError, InputNotFoundError, SchemaVersionError, TraceError
from verify.sampling import SAMPLING_KEY, read_setting

SCHEMA_VERSION = 1
APPLICATION_ID = 0x6D6F6B76  # "mokv"
LOST = -1  # steps.complete of a step that lost records
PHASES = ("forward", "backward", "after_backward")
KINDS = ("input", "output", "grad", "param")
READ_PAGE = 1024
"""Records per read transaction of `Trace.records`: a reader holds a snapshot for one page only."""
CONTRACT_KEY = "execution_contract"
"""Run metadata key: a flat JSON object of what decides the bits (versions, configs, device, ...).
`diff_traces` compares it before any tensor; verify knows none of its keys."""

_SCHEMA = """
CREATE TABLE run (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE steps (
    step INTEGER PRIMARY KEY, n_records INTEGER NOT NULL, complete INTEGER NOT NULL, committed_at REAL NOT NULL
);
CREATE TABLE records (
    step INTEGER NOT NULL, seq INTEGER NOT NULL, phase TEXT NOT NULL, name TEXT NOT NULL, kind TEXT NOT NULL,
    dtype TEXT NOT NULL, shape TEXT NOT NULL, digest TEXT NOT NULL, rows BLOB,
    PRIMARY KEY (step, seq)
) WITHOUT ROWID;
CREATE INDEX records_by_name ON records (name, kind);
"""


@dataclass(frozen=True)
class Record:
    """One recorded tensor. `rows` holds the per-row digests as little-endian uint64 bytes, or None;
    `row_index` the indices of those rows (uint64 bytes) when only some were kept, None for all rows."""

    step: int
    seq: int
    phase: str
    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    digest: str
    rows: bytes | None = None
    row_index: bytes | None = None

    @property
    def key(self) -> tuple[int, str, str, str]:
        """What must agree for two records to be the same event: (step, phase, name, kind)."""
        return (self.step, self.phase, self.name, self.kind)

    def row_digests(self) -> np.ndarray | None:
        """Row digests as uint64 [R], or None when rows were not recorded."""
        return None if self.rows is None else np.frombuffer(self.rows, dtype="<u8")

    def row_indices(self) -> np.ndarray | None:
        """Indices (uint64 [R]) of the rows `row_digests` holds; None when it holds every row in order."""
        return None if self.row_index is None else np.frombuffer(self.row_index, dtype="<u8")


def _open_read_only(uri: str) -> tuple[sqlite3.Connection, int, int]:
    db = sqlite3.connect(uri, uri=True, check_same_thread=False)
    try:
        return db, db.execute("PRAGMA application_id").fetchone()[0], db.execute("PRAGMA user_version").fetchone()[0]
    except sqlite3.DatabaseError:
        db.close()
        raise


class Trace:
    """A trace opened for reading. Raises `InputNotFoundError`, `TraceError` or `SchemaVersionError`."""

    def __init__(self, path: str | os.PathLike):
        self.path = as_path(path, "trace")
        there = what_is_at(self.path)
        if there is None:
            raise InputNotFoundError(f"trace not found: {self.path}")
        if there != "a regular file":
            raise TraceError(f"{self.path} is {there}, not a trace")
        self._checked = False
        self._immutable = False
        # (before connecting: opening a WAL-mode file may create an empty -wal)
        self._had_wal = _nonempty(Path(f"{self.path.resolve()}-wal"))
        try:
            self._db, app_id, version = self._connect()
        except sqlite3.DatabaseError as e:
            if "locked" in str(e):
                raise TraceError(f"{self.path} is locked by another process (a writer holding it exclusively): try "
                                 "again once it is done") from None
            raise TraceError(f"{self.path} is not a verify trace (not a readable SQLite file: {e}){self._torn_hint(e)}"
                             ) from None
        if app_id != APPLICATION_ID:
            self._db.close()
            raise TraceError(f"{self.path} is a SQLite file but not a verify trace")
        if version != SCHEMA_VERSION:
            self._db.close()
            raise SchemaVersionError(
                f"{self.path} has trace schema version {version}; this verify reads version {SCHEMA_VERSION}"
            )
        info = dict(self._query("SELECT key, value FROM run"))
        self.run: str = str(info.get("run", ""))
        try:
            self.meta: dict = json.loads(info.get("meta", "{}"))
        except (TypeError, ValueError) as e:
            raise TraceError(f"{self.path} is a corrupt verify trace: run metadata is not JSON ({e})") from None
        if not isinstance(self.meta, dict):
            raise TraceError(f"{self.path} is a corrupt verify trace: run metadata is not a JSON object")
        if not isinstance(self.meta.get(CONTRACT_KEY, {}), dict):
            raise TraceError(f"{self.path}: metadata '{CONTRACT_KEY}' is not a JSON object")
        # The rate setting (verify/sampling.py): {"every", "row_every", "rule"}; a trace without one is whole.
        self.sampling: dict = read_setting(info.get(SAMPLING_KEY), self.path)
        self.created: float = _as_float(info.get("created"))
        closed = info.get("closed")
        # closed_at: when the writer closed the trace; None while running or after a crash (see `closed`).
        self.closed_at: float | None = _as_float(closed) if closed else None
        # closed: True / False; None for traces written before verify recorded it.
        self.closed: bool | None = None if closed is None else bool(closed)
        if self._immutable and not self.closed:  # an immutable read of a trace still written could tear
            self._db.close()
            raise TraceError(f"{self.path} is not closed (still being written, or its writer crashed) and its folder "
                             "is not writable: reading it needs write access to the folder")
        lost = self._query("SELECT step FROM steps WHERE complete = ? ORDER BY step LIMIT 1", (LOST,))
        if lost:
            self._db.close()
            raise TraceError(f"{self.path}: step {lost[0][0]} lost records (its capture ring overflowed): the trace is "
                             "partial; record again with a larger capacity (Recorder.capture, MOK_TRACE_RING) or a "
                             "lower rate")

    def _connect(self) -> tuple[sqlite3.Connection, int, int]:
        """A read-only connection, its application id and schema version. A WAL-mode reader needs the -shm
        file beside the trace; in a folder it cannot write (a published run) a closed trace without a pending -wal
        is whole in its main file, and is read as immutable instead (no -shm, no locks; __init__ refuses one that
        is not closed)."""
        uri = f"{self.path.resolve().as_uri()}?mode=ro"
        try:
            return _open_read_only(uri)
        except sqlite3.OperationalError as e:
            unwritable = "readonly" in str(e) or "unable to open" in str(e)
            if self._had_wal or not unwritable or os.access(self.path.resolve().parent, os.W_OK):
                raise
        self._immutable = True
        return _open_read_only(uri + "&immutable=1")

    def unclosed_warning(self) -> str | None:
        """One line when the writer never reached close() (crashed or still running), else None."""
        if self.closed is not False:
            return None
        n = len(self.steps())
        return f"trace {self.path} was not closed (crashed or still running): {n} step{'s' if n != 1 else ''}"

    def steps(self) -> list[tuple[int, int, bool]]:
        """Committed steps as (step, n_records, complete), in order."""
        rows = self._query("SELECT step, n_records, complete FROM steps ORDER BY step")
        if not all(isinstance(s, int) and isinstance(n, int) for s, n, _ in rows):
            raise TraceError(f"{self.path} is a corrupt verify trace: a steps row holds a non-integer")
        return [(s, n, bool(c)) for s, n, c in rows]

    def records(self, step: int | None = None, name: str | None = None) -> Iterator[Record]:
        """Records in execution order (step, seq), optionally of one step and/or one name.

        Read in pages of READ_PAGE records, one short read transaction each, so that a long comparison
        never pins a snapshot that the writer's checkpoint would have to wait for. The records are those
        of the steps committed when the iteration began (a step commits whole): a trace still being
        written reads as it was then, whatever the page size."""
        if step is not None:
            step = as_int(step, "records: step")
        if name is not None and not isinstance(name, str):
            raise ArgumentError(f"records: name must be a str or None, got {name!r}")
        last = self._query("SELECT MAX(step) FROM records")[0][0]
        if last is None:
            return
        where, args = ["step <= ?"], [last]
        if step is not None:
            where.append("step = ?")
            args.append(step)
        if name is not None:
            where.append("name = ?")
            args.append(name)
        after: list = []
        while True:
            clauses = where + (["(step, seq) > (?, ?)"] if after else [])
            sql = ("SELECT step, seq, phase, name, kind, dtype, shape, digest, rows FROM records"
                   + (" WHERE " + " AND ".join(clauses) if clauses else "") + " ORDER BY step, seq LIMIT ?")
            rows = self._query(sql, [*args, *after, READ_PAGE])
            for row in rows:
                yield _record(row, self.path, self.sampling["row_every"] > 1)
            if len(rows) < READ_PAGE:
                return
            after = [rows[-1][0], rows[-1][1]]

    def check_integrity(self) -> None:
        """TraceError unless SQLite's integrity check passes (every page, table and index of the file, also
        those a comparison never reads) and every committed step holds exactly the records it counts (no
        record of an uncommitted step). Reads the whole file once; done once per open Trace."""
        if self._checked:
            return
        problems = [row[0] for row in self._query("PRAGMA integrity_check(5)")]
        if problems != ["ok"]:
            raise TraceError(f"{self.path} is a corrupt verify trace: SQLite's integrity check fails: "
                             f"{'; '.join(str(p) for p in problems)}{self._torn_hint()}")
        self.steps()  # its rows are integers
        bad = self._query(
            "SELECT s.step, s.n_records, COUNT(r.step) FROM steps s LEFT JOIN records r ON r.step = s.step "
            "GROUP BY s.step HAVING s.n_records != COUNT(r.step) "
            "UNION ALL SELECT step, NULL, COUNT(*) FROM records WHERE step NOT IN (SELECT step FROM steps) "
            "GROUP BY step LIMIT 1")
        if bad:
            step, counted, found = bad[0]
            what = (f"step {step} counts {counted} records but holds {found}" if counted is not None
                    else f"{found} records belong to step {step!r}, which was never committed")
            raise TraceError(f"{self.path} is a corrupt verify trace: {what}{self._torn_hint()}")
        self._checked = True

    def __len__(self) -> int:
        return self._query("SELECT COUNT(*) FROM records")[0][0]

    @property
    def contract(self) -> dict | None:
        """The metadata's `execution_contract` (a JSON object), or None when the writer stored none."""
        return self.meta.get(CONTRACT_KEY)  # checked to be a dict when the trace was opened

    def _query(self, sql: str, args: Sequence = ()) -> list:
        """All rows of one statement (one short read transaction)."""
        try:
            return self._db.execute(sql, args).fetchall()
        except sqlite3.DatabaseError as e:
            raise TraceError(f"{self.path} is a corrupt verify trace: {e}{self._torn_hint(e)}") from None

    def _torn_hint(self, error: sqlite3.DatabaseError | None = None) -> str:
        """For a malformed or inconsistent file with no -wal beside it and not marked closed: the likely cause,
        a copy without its -wal of a trace whose writer was killed while it checkpointed (the .db alone is
        then inconsistent). error: the SQLite error (a hint only for 'malformed'), None for a failed check."""
        if self._had_wal or (error is not None and "malformed" not in str(error)):
            return ""
        if getattr(self, "closed", None) is True:  # closed by its writer: no checkpoint was cut short
            return ""
        return (f"; if it was copied from a trace whose writer was killed during a checkpoint, it needs the "
                f"trace's {self.path.name}-wal beside it (copy the .db and its -wal together)")

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Trace:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextmanager
def opened(trace: Trace | str | os.PathLike) -> Iterator[Trace]:
    """`with opened(x) as t:` an open Trace is used as is (and left open); a path is opened, closed on exit.
    Raises the errors of `Trace(path)` (ArgumentError for what is neither)."""
    if isinstance(trace, Trace):
        yield trace
    else:
        with Trace(trace) as t:
            yield t


def records_of_steps(trace: Trace, steps: Sequence[int] | None) -> Iterator[Record]:
    """All records, or only those of `steps` (each step filtered in SQL, not read and dropped), in
    (step, seq) order. ArgumentError when steps is not None or a list of ints."""
    steps = as_steps(steps)
    if steps is None:
        return trace.records()
    return itertools.chain.from_iterable(trace.records(step=s) for s in sorted(set(steps)))


def _nonempty(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


def _as_float(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _record(row: tuple, path: Path, sampled: bool = False) -> Record:
    """A Record from a `records` row, checked: a malformed row is a TraceError, never a bare ValueError.
    sampled: the trace keeps some rows (its `rows` BLOBs hold indices, then digests)."""
    s, q, phase, name, kind, dtype, shape, digest, rows = row
    try:
        shape_t = json.loads(shape)
    except (TypeError, ValueError):
        shape_t = None
    if not (isinstance(shape_t, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape_t)):
        raise TraceError(f"{path} is a corrupt verify trace: record (step {s}, seq {q}) has shape {shape!r}, "
                         "not a JSON list of sizes")
    if not (isinstance(s, int) and isinstance(q, int) and all(isinstance(v, str) for v in (phase, name, kind, dtype,
                                                                                          digest))):
        raise TraceError(f"{path} is a corrupt verify trace: record (step {s!r}, seq {q!r}) has a field of the "
                         "wrong type")
    if rows is not None and (not isinstance(rows, bytes) or len(rows) % (16 if sampled else 8)):
        raise TraceError(f"{path} is a corrupt verify trace: record (step {s}, seq {q}) has row digests that are "
                         f"not a whole number of {'(index, digest) pairs of ' if sampled else ''}64-bit words")
    index = None
    if rows is not None and sampled:
        half = len(rows) // 2
        index, rows = rows[:half], rows[half:]
    return Record(s, q, phase, name, kind, dtype, tuple(shape_t), digest, rows, index)
