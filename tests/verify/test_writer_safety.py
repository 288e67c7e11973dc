"""One writer per trace (a second Recorder on the same path is refused, in this process or another),
self-contained .db files (every committed step is in the main file, without its -wal), and the
'not closed' mark of a trace whose writer crashed or still runs."""
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import verify
from verify.cli import main
from verify.errors import RecorderError
from verify.store import Trace

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}


def start_writer(path, steps=3):
    """A child process that commits `steps` steps, records part of one more and sleeps (killed_writer)."""
    proc = subprocess.Popen([sys.executable, str(REPO / "tests/helpers/killed_writer.py"), str(path), str(steps)],
                            stdout=subprocess.PIPE, text=True, env=ENV)
    for line in proc.stdout:
        if line.strip() == "in flight":
            return proc
    proc.kill()
    raise AssertionError("writer did not start")


def kill(proc):
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)


def steps_of(path):
    with Trace(path) as trace:
        return trace.steps()


def test_second_recorder_in_process_is_refused(tmp_path):
    path = tmp_path / "t.db"
    with verify.Recorder(path) as first:
        first.record("a", torch.ones(2))
        first.step()
        for kwargs in ({"overwrite": True}, {}):
            with pytest.raises(RecorderError, match="already being written"):
                verify.Recorder(path, **kwargs)
        with pytest.raises(RecorderError, match="already being written"):  # another spelling of the same path
            verify.Recorder(tmp_path / "." / "t.db", overwrite=True)
        first.record("b", torch.zeros(2))
        first.step()
    with Trace(path) as trace:
        assert [(s, n) for s, n, _ in trace.steps()] == [(0, 1), (1, 1)] and trace.closed is True
    assert not Path(f"{path}.lock").exists()  # released and removed at close
    with verify.Recorder(path, overwrite=True) as again:  # free again once closed
        again.record("c", torch.ones(3))
    assert [r.name for r in Trace(path).records()] == ["c"]


def test_dropped_recorder_releases_the_lock(tmp_path):
    path = tmp_path / "t.db"
    rec = verify.Recorder(path)
    rec.record("a", torch.ones(2))
    rec.step()
    del rec
    import gc

    gc.collect()
    with verify.Recorder(path, overwrite=True):
        pass


def test_second_recorder_in_another_process_is_refused(tmp_path):
    path = tmp_path / "t.db"
    proc = start_writer(path)
    try:
        with pytest.raises(RecorderError, match="another process"):
            verify.Recorder(path, overwrite=True)
        # A third process through the real entry point: refused too, the first writer's steps intact.
        code = ("import sys, verify\n"
                "try:\n    verify.Recorder(sys.argv[1], overwrite=True)\n"
                "except verify.RecorderError as e:\n    print(e); sys.exit(3)\n")
        other = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=ENV)
        assert other.returncode == 3 and "another process" in other.stdout, other.stderr
        assert [s for s, _, _ in steps_of(path)] == [0, 1, 2]
    finally:
        kill(proc)
    # The kernel released the dead writer's lock: the trace can be replaced now.
    with verify.Recorder(path, overwrite=True, run="after") as rec:
        rec.record("x", torch.ones(1))
    with Trace(path) as trace:
        assert trace.run == "after" and len(trace) == 1


def test_db_file_alone_holds_every_committed_step(tmp_path):
    path = tmp_path / "t.db"
    copy = tmp_path / "copy" / "t.db"
    copy.parent.mkdir()
    tensors = [torch.randn(4, 3, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    rec = verify.Recorder(path)
    for i, t in enumerate(tensors):
        rec.record("x", t)
        rec.step()
        shutil.copy(path, copy)  # the .db only, while the writer is open
        with Trace(copy) as trace:
            assert [s for s, _, _ in trace.steps()] == list(range(i + 1))
            assert [r.digest for r in trace.records()] == [verify.fingerprint(x) for x in tensors[:i + 1]]
            assert trace.closed is False
        copy.unlink()
        for suffix in ("-wal", "-shm"):
            Path(f"{copy}{suffix}").unlink(missing_ok=True)
    rec.close()
    shutil.copy(path, copy)
    with Trace(copy) as trace:
        assert len(trace.steps()) == 5 and trace.closed is True and trace.closed_at is not None


def test_db_file_alone_after_sigkill(tmp_path):
    from tests.helpers.killed_writer import step_tensors

    path = tmp_path / "k.db"
    proc = start_writer(path, steps=4)
    kill(proc)
    assert Path(f"{path}-wal").exists()
    copy = tmp_path / "copy" / "k.db"
    copy.parent.mkdir()
    shutil.copy(path, copy)
    with Trace(copy) as trace:
        assert [s for s, _, _ in trace.steps()] == [0, 1, 2, 3]
        for step in range(4):
            assert [r.digest for r in trace.records(step=step)] == [verify.fingerprint(t) for t in step_tensors(step)]
        assert trace.closed is False
        assert trace.unclosed_warning() == f"trace {copy} was not closed (crashed or still running): 4 steps"


def test_cli_warns_about_unclosed_traces(tmp_path):
    closed = tmp_path / "closed.db"
    with verify.Recorder(closed) as rec:
        rec.record("x", torch.ones(2))
    crashed = tmp_path / "crashed.db"
    kill(start_writer(crashed, steps=1))
    run = CliRunner().invoke(main, ["diff", str(closed), str(closed)])
    assert run.exit_code == 0 and run.stderr == ""
    run = CliRunner().invoke(main, ["diff", str(closed), str(crashed)])
    assert run.exit_code == 1
    assert run.stderr.splitlines() == [f"mok-verify: warning: trace {crashed} was not closed "
                                       "(crashed or still running): 1 step"]
    run = CliRunner().invoke(main, ["report", str(crashed), "--against", str(closed), "--out", str(tmp_path / "r")])
    assert f"warning: trace {crashed} was not closed (crashed or still running): 1 step" in run.stderr
    assert str(closed) not in run.stderr


def test_a_reader_holding_a_snapshot_never_stalls_a_step(tmp_path):
    import sqlite3
    import time

    path = tmp_path / "t.db"
    with verify.Recorder(path) as rec:
        rec.record("x", torch.ones(2))
        rec.step()
        reader = sqlite3.connect(path, isolation_level=None)
        reader.execute("BEGIN")
        assert reader.execute("SELECT COUNT(*) FROM records").fetchone() == (1,)  # a read transaction, held
        started = time.monotonic()
        rec.record("x", torch.zeros(2))
        rec.step()
        assert time.monotonic() - started < 2.0  # the checkpoint does not wait for the reader
        reader.execute("COMMIT")
        reader.close()
        rec.record("x", torch.full((2,), 3.0))
        rec.step()  # catches up
        copy = tmp_path / "copy" / "t.db"
        copy.parent.mkdir()
        shutil.copy(path, copy)
        assert [s for s, _, _ in steps_of(copy)] == [0, 1, 2]


def test_lock_is_shared_by_symlinked_spellings_across_processes(tmp_path):
    path = tmp_path / "t.db"
    proc = start_writer(path)
    try:
        (tmp_path / "alias.db").symlink_to(path)  # another name of the same trace file
        with pytest.raises(RecorderError, match="another process"):
            verify.Recorder(tmp_path / "alias.db", overwrite=True)
        assert [s for s, _, _ in steps_of(path)] == [0, 1, 2]
    finally:
        kill(proc)


def test_traces_from_before_the_closed_key_give_no_warning(tmp_path):
    import sqlite3

    path = tmp_path / "old.db"
    with verify.Recorder(path) as rec:
        rec.record("x", torch.ones(2))
    db = sqlite3.connect(path)
    db.execute("DELETE FROM run WHERE key = 'closed'")
    db.commit()
    db.close()
    with Trace(path) as trace:
        assert trace.closed is None and trace.closed_at is None and trace.unclosed_warning() is None
    run = CliRunner().invoke(main, ["diff", str(path), str(path)])
    assert run.exit_code == 0 and run.stderr == ""


def test_a_background_step_taken_at_interpreter_exit_is_written(tmp_path):
    """A background Recorder stepped from an atexit hook (a vLLM worker in the main process closes its tracer there):
    the thread pool takes no more work by then, so the step is written on the calling thread, then the trace closed."""
    path = tmp_path / "t.db"
    script = (f"import atexit, torch, verify\n"
              f"rec = verify.Recorder({str(path)!r}, background=True)\n"
              "rec.record('x', torch.ones(2, 3)); rec.step()\n"
              "def at_exit():\n"
              "    rec.record('x', torch.full((2, 3), 2.0)); rec.step(); rec.close()\n"
              "atexit.register(at_exit)\n")
    done = subprocess.run([sys.executable, "-c", script], env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    with Trace(path) as trace:
        assert [s for s, _, _ in trace.steps()] == [0, 1] and trace.closed is True
        assert [r.digest for r in trace.records()] == [verify.fingerprint(torch.ones(2, 3)),
                                                      verify.fingerprint(torch.full((2, 3), 2.0))]
