"""The trace writer of verify/store.py's format: one transaction per step, one writer per trace (an exclusive
lock on the trace's real path), the WAL checkpointed after each commit and at close. verify/store.py's docstring
gives the format and the durability rules; verify.Recorder is its user."""
from __future__ import annotations

import functools
import json
import os
import sqlite3
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from verify.args import as_flag, as_path
from verify.errors import RecorderError
from verify.sampling import SAMPLING_KEY
from verify.store import _SCHEMA, APPLICATION_ID, CONTRACT_KEY, LOST, SCHEMA_VERSION, Record

try:
    import fcntl
except ImportError:  # not POSIX: only the in-process check below applies
    fcntl = None

CLOSE_WAIT_S = 60.0
"""How long `close()` waits for readers holding an older snapshot before giving up on folding the WAL
into the .db (then it raises RecorderError; nothing is lost: the steps are in the -wal)."""

_HELD: set[str] = set()  # trace paths (resolved) held by a TraceWriter of this process
_HELD_GUARD = threading.Lock()


class _WriterLock:
    """Exclusive lock on `<trace>.lock` for one writer's lifetime (flock: released by the kernel if the
    process dies, so a crashed writer never leaves a stale lock), plus a per-process registry (so a second
    Recorder in the same process is refused whatever the platform)."""

    def __init__(self, path: Path, real_path: Path, *, across_processes: bool = True):
        """across_processes=False: only the per-process registry (verify/writer_process.py's parent side, whose
        writer process takes the file lock)."""
        self.key = str(real_path)
        self.lock_path = Path(f"{self.key}.lock")  # resolved: two spellings (symlinks) share one lock
        self._fd: int | None = None
        with _HELD_GUARD:
            if self.key in _HELD:
                raise RecorderError(f"trace {path} is already being written by a Recorder of this process "
                                    "(close it first)")
            _HELD.add(self.key)
        try:
            if across_processes:
                self._acquire(path)
        except BaseException:
            with _HELD_GUARD:
                _HELD.discard(self.key)
            raise

    def _acquire(self, path: Path) -> None:
        if fcntl is None:
            return
        for _ in range(100):
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise RecorderError(f"cannot create lock file {self.lock_path}: {e.strerror}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise RecorderError(f"trace {path} is being written by another process (lock {self.lock_path} "
                                    "is held); refusing to write it concurrently") from None
            # The holder removes the lock file at close: make sure we locked the file that is there now.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.lock_path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self._fd = fd
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                return
            os.close(fd)
        raise RecorderError(f"cannot lock {self.lock_path}: it keeps being replaced")

    def release(self) -> None:
        if self._fd is not None:
            try:
                self.lock_path.unlink(missing_ok=True)  # while still locked: nobody can hold a stale inode
            finally:
                os.close(self._fd)
                self._fd = None
        with _HELD_GUARD:
            _HELD.discard(self.key)


def checked_arguments(path: str | os.PathLike, run: str, meta: dict | None, overwrite: bool
                      ) -> tuple[Path, str, dict, bool]:
    """A trace writer's arguments checked (RecorderError for a bad one): (path, run, the metadata as the trace
    stores it: a JSON object where what JSON cannot hold is its str, overwrite)."""
    path = as_path(path, "trace path", RecorderError)
    if not isinstance(run, str):
        raise RecorderError(f"run must be a str (a name for the run), got {run!r}")
    overwrite = as_flag(overwrite, "overwrite", RecorderError)
    if meta is not None and not isinstance(meta, dict):
        raise RecorderError(f"run metadata must be a dict, got {type(meta).__name__}")
    if not isinstance((meta or {}).get(CONTRACT_KEY, {}), dict):
        raise RecorderError(f"metadata '{CONTRACT_KEY}' must be a dict (a flat JSON object), got "
                            f"{type(meta[CONTRACT_KEY]).__name__}")
    try:
        meta = json.loads(json.dumps(meta or {}, sort_keys=True, default=str))
    except (TypeError, ValueError) as e:
        raise RecorderError(f"run metadata is not JSON-serialisable: {e}") from None
    return path, run, meta, overwrite


class TraceWriter:
    """Creates a trace file and appends committed steps to it. Used by `verify.Recorder`.

    Holds the trace's writer lock from before anything is replaced until `close()` (see the module
    docstring): a second writer on the same path raises `RecorderError`.
    """

    def __init__(self, path: str | os.PathLike, run: str, meta: dict | None = None, overwrite: bool = False,
                 sampling: dict | None = None):
        self._db = None
        self.path, run, meta, overwrite = checked_arguments(path, run, meta, overwrite)
        meta_json = json.dumps(meta, sort_keys=True)
        # Every file operation goes to the real file: a symlink is written through (and kept), and every
        # spelling of one trace shares one lock.
        self.real_path = real_path(self.path)
        try:
            self.real_path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RecorderError(f"cannot create the folder of {self.path}: {e.strerror}") from None
        self._lock = _WriterLock(self.path, self.real_path)
        try:
            self._create(run, meta_json, overwrite, sampling)
        except BaseException:
            if self._db is not None:
                self._db.close()
                self._db = None
            self._lock.release()
            raise

    def _create(self, run: str, meta_json: str, overwrite: bool, sampling: dict | None) -> None:
        real = self.real_path
        if os.path.lexists(real):
            if not real.is_file():
                raise RecorderError(f"trace {self.path} exists and is not a regular file (a folder, a device, ...): "
                                    "refusing to replace it")
            if not overwrite:
                raise RecorderError(f"trace {self.path} already exists (pass overwrite=True to replace it)")
            try:
                for suffix in ("", "-wal", "-shm"):
                    Path(f"{real}{suffix}").unlink(missing_ok=True)
            except OSError as e:
                raise RecorderError(f"cannot replace trace {self.path}: {e.strerror}") from None
        try:
            self._db = sqlite3.connect(real, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as e:
            raise RecorderError(f"cannot create trace {self.path}: {e}") from None
        # A recorded step is mostly row-digest BLOBs of up to MBs each: 64 KiB pages chain 16x fewer overflow pages
        # than SQLite's 4 KiB default (set before anything is written; readers take any page size).
        self._db.execute("PRAGMA page_size = 65536")
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
             ("writer", json.dumps(_writer_versions())), ("closed", "")]
            + ([(SAMPLING_KEY, json.dumps(sampling, sort_keys=True))] if sampling is not None else []),
        )
        self._db.execute("COMMIT")
        self._checkpoint()

    def _checkpoint(self, wait_s: float = 0.0) -> bool:
        """Copy the WAL into the main file (and empty it), so the .db alone holds every committed step.
        True when it did; False when a reader's snapshot (or `log_metrics` writing) kept some frames out.

        wait_s: how long to wait for such readers (SQLite's busy handler). Per step it is 0: a step never
        waits, a blocked checkpoint copies what it can and the next step's catches up. verify's own
        readers (`Trace`) read in short transactions, so they never hold a snapshot for long."""
        db = self._db
        timeout = db.execute("PRAGMA busy_timeout").fetchone()[0]
        db.execute(f"PRAGMA busy_timeout = {int(wait_s * 1000)}")
        try:
            busy, _, _ = db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        finally:
            db.execute(f"PRAGMA busy_timeout = {int(timeout)}")
        return busy == 0

    def write_step(self, step: int, records: Sequence[Record], complete: bool = True, lost: bool = False) -> None:
        """Commit one step's records in one transaction, then checkpoint the WAL into the main file. complete:
        False for a step cut short (stored 0); lost: records of the step were lost (a capture ring overflowed,
        verify/capture.py; stored -1, and readers refuse the trace)."""
        db = self._db
        if db is None:
            raise RecorderError(f"trace writer for {self.path} is closed")
        db.execute("BEGIN")
        try:
            db.executemany(
                "INSERT INTO records (step, seq, phase, name, kind, dtype, shape, digest, rows) "
                "VALUES (?,?,?,?,?,?,?,?,?)",
                [(r.step, r.seq, r.phase, r.name, r.kind, r.dtype, _shape_json(tuple(r.shape)), r.digest,
                  r.rows if r.row_index is None or r.rows is None else r.row_index + r.rows)  # see verify/sampling.py
                 for r in records],
            )
            db.execute("INSERT INTO steps (step, n_records, complete, committed_at) VALUES (?,?,?,?)",
                       (step, len(records), LOST if lost else int(complete), time.time()))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        self._checkpoint()

    def close(self) -> None:
        """Mark the trace closed (metadata 'closed' = the time), checkpoint, close, release the lock.

        The final checkpoint waits up to CLOSE_WAIT_S seconds for readers holding an older snapshot, so
        that the .db alone holds every committed step once close() returns. A reader that holds its
        snapshot longer gets a RecorderError after everything is closed and unlocked: the steps are then
        safe in `<trace>-wal`, which must stay beside the .db (the trace, .db and -wal, is complete)."""
        if self._db is None:
            return
        folded = False
        try:
            self._db.execute("INSERT OR REPLACE INTO run (key, value) VALUES ('closed', ?)", (repr(time.time()),))
            folded = self._checkpoint(wait_s=CLOSE_WAIT_S)
        finally:
            self._db.close()
            self._db = None
            self._lock.release()
        if not folded:
            raise RecorderError(
                f"trace {self.path} is closed, but a reader held an older snapshot of it for more than "
                f"{CLOSE_WAIT_S:g} s, so the .db file alone lacks the latest steps: they are in {self.real_path}-wal, "
                "which must stay beside the .db (SQLite folds it in when the last read-write connection closes)")

    def __del__(self):
        # Dropped without close(): release the file and the lock, but do not mark the trace closed.
        try:
            if getattr(self, "_db", None) is not None:
                self._db.close()
                self._db = None
                self._lock.release()
        except Exception:  # noqa: BLE001 — interpreter shutdown
            pass


@functools.lru_cache(maxsize=4096)
def _shape_json(shape: tuple[int, ...]) -> str:
    return json.dumps(list(shape))


def real_path(path: Path) -> Path:
    """The file a trace path names, symlinks resolved (also a dangling link's target); RecorderError for a loop."""
    try:
        return path.resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop (before Python 3.13)
        raise RecorderError(f"cannot resolve trace path {path}: {e}") from None


def _writer_versions() -> dict:
    import platform

    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "host": platform.node()}
