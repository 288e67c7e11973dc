"""mok-verify bisect on a throwaway git repository made here: the outputs are committed files the
command copies, so each revision costs a `cp`, not a Python start."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

import verify
from verify.cli import main
from verify.errors import BisectError

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
REPO = Path(__file__).resolve().parents[2]


def git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def make_trace(path, scale):
    with verify.Recorder(path, overwrite=True) as rec:
        x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        rec.record("layers.0.moe", x, kind="input")
        y = x * 2
        y[1, 2] *= scale
        rec.record("layers.0.moe", y)


def make_repo(tmp_path, kind, n=9, first_bad=5, skip=()):
    """Commits 0..n-1; output diverges from commit `first_bad` on; commits in `skip` ask to be skipped."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    git(repo, "config", "user.email", "t@example.com")
    git(repo, "config", "user.name", "t")
    revs = []
    for i in range(n):
        scale = 1.0 if i < first_bad else 1.5
        if kind == "trace":
            make_trace(repo / "out.db", scale)
        else:
            save_file({"w": torch.full((4, 3), scale).bfloat16(), "b": torch.zeros(3)}, repo / "out.safetensors")
        (repo / "SKIP").unlink(missing_ok=True)
        if i in skip:
            (repo / "SKIP").write_text("")
        (repo / "log.txt").write_text(f"commit {i}\n")
        git(repo, "add", "-A", "-f")
        git(repo, "commit", "-q", "-m", f"change {i}")
        revs.append(git(repo, "rev-parse", "HEAD"))
    return repo, revs


CMD = {"trace": "test -f SKIP && exit 125; cp out.db {output}",
       "checkpoint": "test -f SKIP && exit 125; cp out.safetensors \"$MOK_VERIFY_OUTPUT\""}


@pytest.mark.parametrize("kind", ["trace", "checkpoint"])
def test_finds_first_diverging_revision(tmp_path, kind):
    repo, revs = make_repo(tmp_path, kind)
    lines = []
    result = verify.bisect(repo, revs[0], revs[-1], CMD[kind], log=lines.append)
    assert result.first_bad == revs[5] and result.subject == "change 5"
    assert len(result.tested) <= 2 + 4  # good, bad and a binary search over 7 candidates
    assert "differ" in result.divergence
    assert git(repo, "worktree", "list").count("\n") == 0  # the throwaway worktree is gone
    assert git(repo, "status", "--porcelain") == ""


def test_cli_prints_revision_and_divergence(tmp_path):
    repo, revs = make_repo(tmp_path, "trace")
    run = CliRunner().invoke(main, ["bisect", "--repo", str(repo), "--good", revs[0], "--bad", "HEAD",
                                    "--cmd", CMD["trace"]])
    assert run.exit_code == 1
    assert f"first diverging revision: {revs[5]} change 5" in run.stdout
    assert "layers.0.moe [output]" in run.stdout and "rows differing: 1 of 3: [1]" in run.stdout
    run = CliRunner().invoke(main, ["bisect", "--repo", str(repo), "--good", revs[0], "--bad", revs[-1],
                                    "--cmd", CMD["trace"], "--json"])
    doc = json.loads(run.stdout)
    assert run.exit_code == 1 and doc["first_bad"] == revs[5] and doc["divergence"]["divergence"]["rows"] == [1]


def test_output_option_and_skipped_revisions(tmp_path):
    repo, revs = make_repo(tmp_path, "checkpoint", skip={3, 4})
    cmd = "test -f SKIP && exit 125; mkdir -p o && cp out.safetensors o/m.safetensors"
    result = verify.bisect(repo, revs[0], revs[-1], cmd, output="o/m.safetensors", log=lambda _: None)
    assert result.first_bad == revs[5]
    assert {r for r, s in result.tested if s == "skip"} <= {revs[3], revs[4]}


def test_no_divergence_exits_zero(tmp_path):
    repo, revs = make_repo(tmp_path, "checkpoint", first_bad=100)
    result = verify.bisect(repo, revs[0], revs[-1], CMD["checkpoint"], log=lambda _: None)
    assert result.first_bad is None
    run = CliRunner().invoke(main, ["bisect", "--repo", str(repo), "--good", revs[0], "--bad", revs[-1],
                                    "--cmd", CMD["checkpoint"]])
    assert run.exit_code == 0 and "no divergence" in run.stdout


def test_failures_are_typed(tmp_path):
    repo, revs = make_repo(tmp_path, "checkpoint", n=3)
    with pytest.raises(BisectError, match="exit code 3"):
        verify.bisect(repo, revs[0], revs[-1], "echo broken >&2; exit 3", log=lambda _: None)
    with pytest.raises(BisectError, match="unknown revision"):
        verify.bisect(repo, "no-such-rev", revs[-1], CMD["checkpoint"])
    with pytest.raises(BisectError, match="not an ancestor"):
        verify.bisect(repo, revs[-1], revs[0], CMD["checkpoint"])
    with pytest.raises(BisectError, match="wrote no output"):
        verify.bisect(repo, revs[0], revs[-1], "true", log=lambda _: None)
    (tmp_path / "plain").mkdir()
    with pytest.raises(BisectError, match="rev-parse"):
        verify.bisect(tmp_path / "plain", "a", "b", "true")
    assert git(repo, "worktree", "list").count("\n") == 0


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()


def test_timeout_skips_a_hanging_revision_and_kills_its_process_group(tmp_path):
    repo, revs = make_repo(tmp_path, "trace", skip={4})
    pids = tmp_path / "pids"
    # At the hanging revision the shell starts a background sleep (same process group) and waits on it.
    cmd = f"if test -f SKIP; then sleep 100 & echo $! >> {pids}; wait; fi; cp out.db {{output}}"
    lines = []
    started = time.monotonic()
    result = verify.bisect(repo, revs[0], revs[-1], cmd, log=lines.append, timeout=1)
    assert time.monotonic() - started < 60
    assert result.first_bad == revs[5] and result.timed_out == [revs[4]]
    assert (revs[4], "skip") in result.tested
    assert f"[bisect] {revs[4][:12]} skip (timed out after 1 s)" in lines
    assert f"timed out after 1 s, counted as skipped: {revs[4][:12]}" in result.describe()
    assert result.to_json()["timed_out"] == [revs[4]]
    sleepers = [int(p) for p in pids.read_text().split()]
    assert len(sleepers) == 1 and not pid_alive(sleepers[0])
    assert git(repo, "worktree", "list").count("\n") == 0
    run = CliRunner().invoke(main, ["bisect", "--repo", str(repo), "--good", revs[0], "--bad", revs[-1],
                                    "--cmd", cmd, "--timeout", "1"])
    assert run.exit_code == 1 and f"first diverging revision: {revs[5]}" in run.stdout
    assert f"timed out after 1 s, counted as skipped: {revs[4][:12]}" in run.stdout
    assert f"{revs[4][:12]} skip (timed out after 1 s)" in run.stderr


def test_timeout_at_the_good_revision_is_an_error(tmp_path):
    repo, revs = make_repo(tmp_path, "checkpoint", n=3)
    with pytest.raises(BisectError, match=r"timed out \(after 0.5 s\) at the good revision"):
        verify.bisect(repo, revs[0], revs[-1], "sleep 100", log=lambda _: None, timeout=0.5)
    assert git(repo, "worktree", "list").count("\n") == 0
    run = CliRunner().invoke(main, ["bisect", "--repo", str(repo), "--good", revs[0], "--bad", revs[-1],
                                    "--cmd", "true", "--timeout", "0"])
    assert run.exit_code == 2


def test_sigterm_cleans_up_worktree_tempdir_and_command(tmp_path):
    repo, revs = make_repo(tmp_path, "checkpoint", n=3)
    pids = tmp_path / "pids"
    cmd = f"sleep 100 & echo $! > {pids}; wait"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "verify.cli", "bisect", "--repo", str(repo), "--good", revs[0],
                             "--bad", revs[-1], "--cmd", cmd], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (pids.exists() and pids.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        worktrees = git(repo, "worktree", "list", "--porcelain").splitlines()
        paths = [Path(line.split(" ", 1)[1]) for line in worktrees if line.startswith("worktree ")]
        assert len(paths) == 2
        tmp_dir = paths[1].parent
        assert tmp_dir.name.startswith("mok-verify-bisect-") and tmp_dir.is_dir()
        sleeper = int(pids.read_text())
        assert pid_alive(sleeper)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGTERM
    assert git(repo, "worktree", "list").count("\n") == 0
    assert not tmp_dir.exists()
    assert not pid_alive(sleeper)
