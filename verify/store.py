"""Trace files: SQLite (stdlib sqlite3, WAL), one transaction per step.

Schema (version SCHEMA_VERSION, stored as PRAGMA user_version; PRAGMA application_id marks the file
as a verify trace):
  run(key, value)                         run name, JSON metadata, creation time, writer versions
  steps(step, n_records, complete, committed_at)
  records(step, seq, phase, name, kind, dtype, shape, digest, rows)
    seq    execution order inside the step, from 0
    phase  forward | backward | after_backward
    kind   input | output | grad | param
    shape  JSON list; digest = verify.fingerprint hex; rows = row digests, little-endian uint64 BLOB
A step's records and its `steps` row commit together, so a process killed mid-run leaves every
completed step readable and loses at most the step in flight.
"""
from __future__ import annotations

import itertools
import json
import os
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from verify.errors import InputNotFoundError, RecorderError, SchemaVersionError, TraceError

SCHEMA_VERSION = 1
APPLICATION_ID = 0x6D6F6B76  # "mokv"
PHASES = ("forward", "backward", "after_backward")
KINDS = ("input", "output", "grad", "param")

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
    """One recorded tensor. `rows` holds the per-row digests as little-endian uint64 bytes, or None."""

    step: int
    seq: int
    phase: str
    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    digest: str
    rows: bytes | None = None

    @property
    def key(self) -> tuple[int, str, str, str]:
        """What must agree for two records to be the same event: (step, phase, name, kind)."""
        return (self.step, self.phase, self.name, self.kind)

    def row_digests(self) -> np.ndarray | None:
        """Row digests as uint64 [R], or None when rows were not recorded."""
        return None if self.rows is None else np.frombuffer(self.rows, dtype="<u8")


class TraceWriter:
    """Creates a trace file and appends committed steps to it. Used by `verify.Recorder`."""

    def __init__(self, path: str | os.PathLike, run: str, meta: dict | None = None, overwrite: bool = False):
        self.path = Path(path)
        if self.path.exists():
            if not overwrite:
                raise RecorderError(f"trace {self.path} already exists (pass overwrite=True to replace it)")
            for suffix in ("", "-wal", "-shm"):
                Path(f"{self.path}{suffix}").unlink(missing_ok=True)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            meta_json = json.dumps(meta or {}, sort_keys=True, default=str)
        except (TypeError, ValueError) as e:
            raise RecorderError(f"run metadata is not JSON-serialisable: {e}") from None
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode: a commit survives the process being killed (not a power cut), and is cheap.
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("BEGIN")
        for statement in _SCHEMA.strip().split(";"):
            if statement.strip():
                self._db.execute(statement)
        self._db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        self._db.executemany(
            "INSERT INTO run (key, value) VALUES (?, ?)",
            [("run", run), ("meta", meta_json), ("created", repr(time.time())), ("schema_version", str(SCHEMA_VERSION)),
             ("writer", json.dumps(_writer_versions()))],
        )
        self._db.execute("COMMIT")

    def write_step(self, step: int, records: Sequence[Record], complete: bool = True) -> None:
        """Commit one step's records in one transaction."""
        db = self._db
        db.execute("BEGIN")
        try:
            db.executemany(
                "INSERT INTO records (step, seq, phase, name, kind, dtype, shape, digest, rows) "
                "VALUES (?,?,?,?,?,?,?,?,?)",
                [(r.step, r.seq, r.phase, r.name, r.kind, r.dtype, json.dumps(list(r.shape)), r.digest, r.rows)
                 for r in records],
            )
            db.execute("INSERT INTO steps (step, n_records, complete, committed_at) VALUES (?,?,?,?)",
                       (step, len(records), int(complete), time.time()))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


def _writer_versions() -> dict:
    import platform

    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "host": platform.node()}


class Trace:
    """A trace opened for reading. Raises `InputNotFoundError`, `TraceError` or `SchemaVersionError`."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise InputNotFoundError(f"trace not found: {self.path}")
        try:
            self._db = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False)
            app_id = self._db.execute("PRAGMA application_id").fetchone()[0]
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
        except sqlite3.DatabaseError as e:
            raise TraceError(f"{self.path} is not a verify trace (not a readable SQLite file: {e})") from None
        if app_id != APPLICATION_ID:
            self._db.close()
            raise TraceError(f"{self.path} is a SQLite file but not a verify trace")
        if version != SCHEMA_VERSION:
            self._db.close()
            raise SchemaVersionError(
                f"{self.path} has trace schema version {version}; this verify reads version {SCHEMA_VERSION}"
            )
        try:
            info = dict(self._db.execute("SELECT key, value FROM run").fetchall())
        except sqlite3.DatabaseError as e:
            raise TraceError(f"{self.path} is a corrupt verify trace: {e}") from None
        self.run: str = info.get("run", "")
        self.meta: dict = json.loads(info.get("meta", "{}"))
        self.created: float = float(info.get("created", "nan"))

    def steps(self) -> list[tuple[int, int, bool]]:
        """Committed steps as (step, n_records, complete), in order."""
        rows = self._query("SELECT step, n_records, complete FROM steps ORDER BY step")
        return [(s, n, bool(c)) for s, n, c in rows]

    def records(self, step: int | None = None, name: str | None = None) -> Iterator[Record]:
        """Records in execution order (step, seq), optionally of one step and/or one name."""
        sql = "SELECT step, seq, phase, name, kind, dtype, shape, digest, rows FROM records"
        where, args = [], []
        if step is not None:
            where.append("step = ?")
            args.append(step)
        if name is not None:
            where.append("name = ?")
            args.append(name)
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY step, seq"
        for s, q, phase, nm, kind, dtype, shape, digest, rows in self._query(sql, args, lazy=True):
            yield Record(s, q, phase, nm, kind, dtype, tuple(json.loads(shape)), digest, rows)

    def __len__(self) -> int:
        return self._query("SELECT COUNT(*) FROM records")[0][0]

    def _query(self, sql: str, args: Sequence = (), lazy: bool = False):
        try:
            cursor = self._db.execute(sql, args)
            if not lazy:
                return cursor.fetchall()
            return _guarded(cursor, self.path)
        except sqlite3.DatabaseError as e:
            raise TraceError(f"{self.path} is a corrupt verify trace: {e}") from None

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Trace:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextmanager
def opened(trace: Trace | str | os.PathLike) -> Iterator[Trace]:
    """`with opened(x) as t:` an open Trace is used as is (and left open); a path is opened, closed on exit."""
    if isinstance(trace, Trace):
        yield trace
    else:
        with Trace(trace) as t:
            yield t


def records_of_steps(trace: Trace, steps: Sequence[int] | None) -> Iterator[Record]:
    """All records, or only those of `steps` (each step filtered in SQL, not read and dropped), in
    (step, seq) order."""
    if steps is None:
        return trace.records()
    return itertools.chain.from_iterable(trace.records(step=s) for s in sorted(set(steps)))


def _guarded(cursor: sqlite3.Cursor, path: Path) -> Iterator:
    try:
        yield from cursor
    except sqlite3.DatabaseError as e:
        raise TraceError(f"{path} is a corrupt verify trace: {e}") from None
