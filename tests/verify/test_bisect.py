"""mok-verify bisect on a throwaway git repository made here: the outputs are committed files the
command copies, so each revision costs a `cp`, not a Python start."""
import json
import shutil
import subprocess

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

import verify
from verify.cli import main
from verify.errors import BisectError

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


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
