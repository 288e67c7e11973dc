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
