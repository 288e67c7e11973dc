"""What a trace keeps under concurrency, crashes, copies and symlinks (docs/contracts.md, Fingerprints and
traces: durability): a symlinked path is written through (one lock, the link kept), a reader never costs
the `.db` its steps once the writer closed, a SIGKILL at any moment leaves the `.db` with its `-wal`
holding every committed step, and `mok-verify hash` never writes a manifest over its input."""
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import verify
import verify.trace_writer
from verify.cli import main
from verify.errors import RecorderError
from verify.store import Trace

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}


def steps_of(path):
    with Trace(path) as trace:
        return [s for s, _, _ in trace.steps()]


def start_writer(path, steps=3, loop=False):
    """A child process (tests/helpers/killed_writer.py): commits `steps` steps (or, with loop, keeps
    committing), printing 'committed <step>' after each."""
    args = [sys.executable, str(REPO / "tests/helpers/killed_writer.py"), str(path), str(steps)]
    proc = subprocess.Popen(args + (["--loop"] if loop else []), stdout=subprocess.PIPE, text=True, env=ENV)
    if loop:
        return proc
    for line in proc.stdout:
        if line.strip() == "in flight":
            return proc
    proc.kill()
    raise AssertionError("writer did not start")


def write(path, run, steps, **kwargs):
    rec = verify.Recorder(path, run=run, **kwargs)
    for i in range(steps):
        rec.record("x", torch.full((2,), float(i)))
        rec.step()
    return rec


# -- 1. symlinks -------------------------------------------------------------------------------------

def test_a_symlinked_trace_is_written_through_its_link(tmp_path):
    real, link = tmp_path / "real.db", tmp_path / "link.db"
    write(real, "old", 1).close()
    link.symlink_to(real.name)
    first = write(link, "first", 3, overwrite=True)
    assert link.is_symlink() and link.resolve() == real  # the link is kept: the target was replaced
    for path in (link, real):  # both spellings are the trace the first writer holds
        with pytest.raises(RecorderError, match="already being written"):
            verify.Recorder(path, run="second", overwrite=True)
    first.close()
    assert link.is_symlink()
    with Trace(link) as trace:
        assert trace.run == "first" and [s for s, _, _ in trace.steps()] == [0, 1, 2]
    assert steps_of(real) == [0, 1, 2]
    assert not Path(f"{real}.lock").exists() and not Path(f"{link}.lock").exists()


def test_a_symlinked_trace_in_another_process_is_refused(tmp_path):
    real, link = tmp_path / "real.db", tmp_path / "link.db"
    link.symlink_to(real)  # dangling: the writer creates the target through the link
    proc = start_writer(link)
    try:
        assert link.is_symlink()
        for path in (link, real):
            with pytest.raises(RecorderError, match="another process"):
                verify.Recorder(path, overwrite=True)
        assert link.is_symlink() and steps_of(link) == [0, 1, 2]
    finally:
        proc.kill()
        proc.wait(timeout=60)


def test_a_dangling_symlink_creates_its_target(tmp_path):
    link = tmp_path / "link.db"
    link.symlink_to(tmp_path / "sub" / "real.db")
    write(link, "run", 2).close()
    assert link.is_symlink() and steps_of(tmp_path / "sub" / "real.db") == [0, 1]


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_directory_is_not_a_trace_to_write(tmp_path, overwrite):
    folder = tmp_path / "folder.db"
    folder.mkdir()
    (folder / "keep").write_text("x")
    with pytest.raises(RecorderError, match="not a regular file"):
        verify.Recorder(folder, overwrite=overwrite)
    link = tmp_path / "to_folder.db"
    link.symlink_to(folder)
    with pytest.raises(RecorderError, match="not a regular file"):
        verify.Recorder(link, overwrite=overwrite)
    assert (folder / "keep").read_text() == "x" and link.is_symlink()
    loop = tmp_path / "loop.db"
    loop.symlink_to(loop)
    with pytest.raises(RecorderError):
        verify.Recorder(loop, overwrite=overwrite)


# -- 2. readers -------------------------------------------------------------------------------------

def copy_db_alone(path, tmp_path, name="copy"):
    """The `.db` file copied without its -wal / -shm, as a user copying the trace file would."""
    copy = tmp_path / name / Path(path).name
    copy.parent.mkdir(exist_ok=True)
    shutil.copy(path, copy)
    for suffix in ("-wal", "-shm"):
        Path(f"{copy}{suffix}").unlink(missing_ok=True)
    return copy


@pytest.mark.parametrize("page", [2, 1024])
def test_a_diff_reading_the_trace_never_costs_the_db_its_steps(tmp_path, monkeypatch, page):
    import verify.store

    monkeypatch.setattr(verify.store, "READ_PAGE", page)
    path = tmp_path / "t.db"
    rec = write(path, "run", 5)
    with Trace(path) as reader:
        records = reader.records()
        assert next(records).step == 0  # a diff in progress on the trace
        for i in range(5, 60):
            rec.record("x", torch.full((2,), float(i)))
            rec.step()
            if i == 30:  # while the writer runs, each step reaches the .db as it commits
                assert steps_of(copy_db_alone(path, tmp_path, "running")) == list(range(31))
        rec.close()
        assert steps_of(copy_db_alone(path, tmp_path)) == list(range(60))
        assert [r.step for r in records] == [1, 2, 3, 4]  # the reader reads the trace as its iteration began


def test_a_cli_diff_running_on_the_trace_never_costs_the_db_its_steps(tmp_path):
    path = tmp_path / "t.db"
    other = tmp_path / "other.db"
    write(other, "run", 60).close()
    rec = write(path, "run", 5)
    stop = threading.Event()
    codes = []

    def diffs():
        while not stop.is_set():
            codes.append(CliRunner().invoke(main, ["diff", str(path), str(other)]).exit_code)

    reader = threading.Thread(target=diffs)
    reader.start()
    try:
        for i in range(5, 60):
            rec.record("x", torch.full((2,), float(i)))
            rec.step()
        rec.close()
    finally:
        stop.set()
        reader.join()
    assert codes and set(codes) <= {0, 1}
    assert steps_of(copy_db_alone(path, tmp_path)) == list(range(60))


def test_close_waits_for_a_reader_holding_an_old_snapshot(tmp_path):
    path = tmp_path / "t.db"
    rec = write(path, "run", 5)
    reader = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    reader.execute("BEGIN")
    assert reader.execute("SELECT COUNT(*) FROM steps").fetchone() == (5,)  # a snapshot at step 5, held
    for i in range(5, 60):
        rec.record("x", torch.full((2,), float(i)))
        rec.step()  # never waits for the reader
    ended = threading.Timer(1.0, lambda: reader.execute("COMMIT"))
    ended.start()
    started = time.monotonic()
    rec.close()  # waits (at most verify.trace_writer.CLOSE_WAIT_S) for the reader to let go of its snapshot
    assert time.monotonic() - started >= 0.5
    ended.join()
    reader.close()
    assert steps_of(copy_db_alone(path, tmp_path)) == list(range(60))


def test_close_says_when_a_reader_holds_its_snapshot_too_long(tmp_path, monkeypatch):
    import verify.store

    monkeypatch.setattr(verify.trace_writer, "CLOSE_WAIT_S", 0.3)
    path = tmp_path / "t.db"
    rec = write(path, "run", 5)
    reader = sqlite3.connect(path, isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT COUNT(*) FROM steps").fetchone()
    for i in range(5, 60):
        rec.record("x", torch.full((2,), float(i)))
        rec.step()
    with pytest.raises(RecorderError, match=r"t\.db-wal"):
        rec.close()
    assert not Path(f"{path}.lock").exists()  # closed and unlocked all the same
    with Trace(path) as trace:  # the trace (the .db with its -wal) holds every step, and is marked closed
        assert [s for s, _, _ in trace.steps()] == list(range(60)) and trace.closed is True
    reader.execute("COMMIT")
    reader.close()  # the last read-write connection folds the -wal in as it closes
    assert steps_of(copy_db_alone(path, tmp_path)) == list(range(60))


# -- 3. crashes -------------------------------------------------------------------------------------

def wal_pages(wal: bytes) -> tuple[int, dict[int, bytes]]:
    """(page size, page number -> its last version) of the valid frames of a SQLite WAL file."""
    import struct

    page_size = struct.unpack(">I", wal[8:12])[0]
    salts = wal[16:24]
    pages, offset = {}, 32
    while offset + 24 + page_size <= len(wal) and wal[offset + 8:offset + 16] == salts:
        pages[struct.unpack(">I", wal[offset:offset + 4])[0]] = wal[offset + 24:offset + 24 + page_size]
        offset += 24 + page_size
    return page_size, pages


def test_a_db_torn_by_a_kill_during_a_checkpoint_is_refused_and_whole_with_its_wal(tmp_path):
    """A SIGKILL during the per-step checkpoint leaves the .db with the first pages of the checkpoint (SQLite
    copies pages in ascending order) and the rest old: every such state, made exactly. Alone, the .db is
    refused (TraceError naming the -wal it needs), never read as another trace; with its -wal it holds
    every committed step."""
    path = tmp_path / "t.db"

    def tensor(i):
        return torch.randn(64, 33, generator=torch.Generator().manual_seed(i))

    rec = verify.Recorder(path)
    for i in range(10):
        if i == 5:  # from here on the checkpoints are held back (a reader's snapshot): the -wal holds steps 5..9
            reader = sqlite3.connect(path, isolation_level=None)
            reader.execute("BEGIN")
            reader.execute("SELECT COUNT(*) FROM steps").fetchone()
        rec.record("x", tensor(i))
        rec.record("y", tensor(100 + i))
        rec.step()
    db, wal = path.read_bytes(), Path(f"{path}-wal").read_bytes()  # the files as a SIGKILL here leaves them
    reader.execute("COMMIT")
    reader.close()
    rec.close()
    page_size, pages = wal_pages(wal)
    order = sorted(pages)
    assert len(order) > 2
    for written in range(1, len(order)):  # killed after the checkpoint wrote this many pages
        torn = bytearray(db)
        for page in order[:written]:
            start = (page - 1) * page_size
            torn.extend(b"\0" * max(0, start + page_size - len(torn)))
            torn[start:start + page_size] = pages[page]
        alone = tmp_path / f"alone{written}" / "t.db"
        alone.parent.mkdir()
        alone.write_bytes(bytes(torn))
        with pytest.raises(verify.TraceError, match=r"t\.db-wal"):
            verify.diff_traces(alone, path)
        run = CliRunner().invoke(main, ["diff", str(alone), str(path)])
        assert run.exit_code == 2 and "t.db-wal" in run.stderr
        with_wal = tmp_path / f"with_wal{written}" / "t.db"
        with_wal.parent.mkdir()
        with_wal.write_bytes(bytes(torn))
        Path(f"{with_wal}-wal").write_bytes(wal)
        assert steps_of(with_wal) == list(range(10))
        assert verify.diff_traces(with_wal, path).identical


def test_sigkill_at_any_moment_keeps_every_committed_step(tmp_path):
    """Writers killed at random moments of a loop of steps: the .db with its -wal holds every step whose
    step() returned, each whole; the .db alone holds them too, or (killed during a checkpoint) is refused."""
    import random

    from tests.helpers.killed_writer import step_tensors

    rng = random.Random(0)
    for kill in range(6):
        path = tmp_path / f"k{kill}" / "t.db"
        path.parent.mkdir()
        proc = start_writer(path, steps=0, loop=True)
        committed = -1
        target = rng.randrange(3, 40)
        for line in proc.stdout:
            committed = int(line.split()[1])
            if committed >= target:
                break
        time.sleep(rng.random() * 0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        alone = copy_db_alone(path, tmp_path, f"alone{kill}")
        for copy, may_be_torn in ((path, False), (alone, True)):
            try:
                with Trace(copy) as trace:
                    trace.check_integrity()  # what every verdict (diff, align, report) asks first
                    steps = [s for s, _, _ in trace.steps()]
                    assert steps == list(range(len(steps))) and len(steps) > committed
                    for step in steps:
                        assert [r.digest for r in trace.records(step=step)] == [
                            verify.fingerprint(t) for t in step_tensors(step)]
            except verify.TraceError as e:
                assert may_be_torn and "t.db-wal" in str(e), e


# -- 4. hash -o over an input ------------------------------------------------------------------------

def _sharded(root):
    from safetensors.torch import save_file

    root.mkdir()
    save_file({"a": torch.ones(3)}, root / "model-00001-of-00002.safetensors")
    save_file({"b": torch.zeros(2)}, root / "model-00002-of-00002.safetensors")
    (root / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}')
    return root


@pytest.mark.parametrize("case", ["same", "symlink", "hardlink", "other-spelling", "shard", "index", "manifest"])
def test_hash_never_writes_its_manifest_over_an_input(tmp_path, case):
    from safetensors.torch import save_file

    single = tmp_path / "m.safetensors"
    save_file({"w": torch.arange(6.0)}, single)
    source, output = single, single
    if case == "symlink":
        output = tmp_path / "out.json"
        output.symlink_to(single)
    elif case == "hardlink":
        output = tmp_path / "out.json"
        os.link(single, output)
    elif case == "other-spelling":
        output = tmp_path / "." / "m.safetensors"
    elif case in ("shard", "index"):
        source = _sharded(tmp_path / "sharded")
        output = source / ("model-00002-of-00002.safetensors" if case == "shard" else "model.safetensors.index.json")
    elif case == "manifest":
        source = output = tmp_path / "m.json"
        assert CliRunner().invoke(main, ["hash", str(single), "-o", str(source)]).exit_code == 0
    files = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    run = CliRunner().invoke(main, ["hash", str(source), "-o", str(output)])
    assert run.exit_code == 2, run.output
    assert "mok-verify: error:" in run.stderr and "input" in run.stderr
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == files  # nothing written


def test_hash_writes_a_new_manifest_beside_or_inside_its_input(tmp_path):
    source = _sharded(tmp_path / "sharded")
    for output in (tmp_path / "m.json", source / "manifest.json"):
        run = CliRunner().invoke(main, ["hash", str(source), "-o", str(output)])
        assert run.exit_code == 0, run.output
        assert sorted(verify.hash_checkpoint(output)["tensors"]) == ["a", "b"]
    assert verify.compare_checkpoints(source, source / "manifest.json").identical


def _folder_not_writable(monkeypatch):
    """What SQLite does to a WAL-mode reader in a folder it cannot write (root ignores permissions, so the folder
    is simulated): the plain read-only open fails, as it cannot create the -shm file."""
    import verify.store

    opened = verify.store._open_read_only

    def open_read_only(uri):
        if "immutable=1" not in uri:
            raise sqlite3.OperationalError("attempt to write a readonly database")
        return opened(uri)

    monkeypatch.setattr(verify.store, "_open_read_only", open_read_only)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if mode == os.W_OK else real_access(path, mode))


def test_a_closed_trace_in_a_folder_it_cannot_write_is_read_whole(tmp_path, monkeypatch):
    path = tmp_path / "published.db"
    with verify.Recorder(path) as rec:
        for step in range(3):
            rec.record("x", torch.full((2, 3), float(step)))
            rec.step()
    _folder_not_writable(monkeypatch)
    assert steps_of(path) == [0, 1, 2]
    run = CliRunner().invoke(main, ["diff", str(path), str(path)])
    assert run.exit_code == 0 and run.stdout.startswith("identical: 3 records"), run.output


def test_a_trace_with_a_pending_wal_is_not_read_as_immutable(tmp_path, monkeypatch):
    path = tmp_path / "crashed.db"
    with verify.Recorder(path) as rec:
        rec.record("x", torch.ones(2, 3))
    # A writer killed between a commit and its checkpoint leaves the step in the -wal only: an immutable read
    # (which ignores the -wal) would miss it, so such a trace is refused rather than read short.
    Path(f"{path}-wal").write_bytes(b"\x00" * 64)
    _folder_not_writable(monkeypatch)
    with pytest.raises(verify.TraceError, match="readonly"):
        Trace(path)


def test_a_trace_still_written_in_a_folder_it_cannot_write_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "live.db"
    rec = verify.Recorder(path)
    rec.record("x", torch.ones(2, 3))
    rec.step()  # committed and checkpointed (no -wal pending), but the writer goes on: an immutable read could tear
    try:
        _folder_not_writable(monkeypatch)
        with pytest.raises(verify.TraceError, match="not closed"):
            Trace(path)
    finally:
        monkeypatch.undo()
        rec.close()
