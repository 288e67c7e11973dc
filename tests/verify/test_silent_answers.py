"""No silent wrong answer from verify: every tensor of a .pt checkpoint is compared, a missing partner
trace, a corrupt page or a NaN in a contract never passes for a verdict, an interrupt is not 'diverged'."""
import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import verify
from verify.cli import main

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}


# -- 6. .pt checkpoints: every tensor, every name ------------------------------------------------------

@pytest.mark.parametrize("container", [list, tuple])
def test_tensors_inside_lists_are_compared(tmp_path, container):
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save({"l": container([torch.zeros(3), {"w": torch.ones(2)}]), "x": torch.ones(1)}, a)
    torch.save({"l": container([torch.ones(3), {"w": torch.ones(2)}]), "x": torch.ones(1)}, b)
    result = verify.compare_checkpoints(a, b)
    assert not result.identical
    assert [d.name for d in result.differing] == ["l.0"] and result.n_identical == 2
    assert sorted(verify.hash_checkpoint(a)["tensors"]) == ["l.0", "l.1.w", "x"]
    run = CliRunner().invoke(main, ["checkpoint", str(a), str(b)])
    assert run.exit_code == 1 and "differs: l.0" in run.output


def test_colliding_flattened_names_are_refused(tmp_path):
    path = tmp_path / "c.pt"
    torch.save({"a.b": torch.zeros(2), "a": {"b": torch.ones(2)}}, path)
    with pytest.raises(verify.CheckpointError, match="a.b"):
        verify.compare_checkpoints(path, path)
    run = CliRunner().invoke(main, ["checkpoint", str(path), str(path)])
    assert run.exit_code == 2 and "a.b" in run.stderr
    listed = tmp_path / "l.pt"
    torch.save({"l.0": torch.zeros(2), "l": [torch.ones(2)]}, listed)
    with pytest.raises(verify.CheckpointError, match="l.0"):
        verify.hash_checkpoint(listed)


# -- 8. report: a partner that is not there ------------------------------------------------------------

def _trace(path, run="run", meta=None, values=(1.0, 2.0)):
    with verify.Recorder(path, run=run, meta=meta) as rec:
        for v in values:
            rec.record("x", torch.full((3,), v))
            rec.step()
    return path


def test_report_with_a_missing_partner_is_an_error(tmp_path):
    trace = _trace(tmp_path / "trainer.db", meta={"partner": "sampler.db"})
    with pytest.raises(verify.InputNotFoundError, match="sampler.db"):
        from verify.report import build_report

        build_report(trace, tmp_path / "out")
    run = CliRunner().invoke(main, ["report", str(trace), "--out", str(tmp_path / "out")])
    assert run.exit_code == 2 and "sampler.db" in run.stderr and "partner" in run.stderr
    _trace(tmp_path / "sampler.db")  # once it is there, the report compares
    run = CliRunner().invoke(main, ["report", str(trace), "--out", str(tmp_path / "out")])
    assert run.exit_code == 0, run.output


@pytest.mark.parametrize("partner", [3, ["a.db"], {"p": 1}, True])
def test_report_with_a_malformed_partner_is_a_trace_error(tmp_path, partner):
    trace = _trace(tmp_path / "t.db", meta={"partner": partner})
    run = CliRunner().invoke(main, ["report", str(trace), "--out", str(tmp_path / "out")])
    assert run.exit_code == 2 and "partner" in run.stderr and "unexpected" not in run.stderr


def test_report_without_a_partner_compares_nothing_and_says_so(tmp_path):
    trace = _trace(tmp_path / "t.db")
    run = CliRunner().invoke(main, ["report", str(trace), "--out", str(tmp_path / "out")])
    assert run.exit_code == 0
    assert "nothing to compare" not in (tmp_path / "out" / "report.html").read_text()


# -- 9. a corrupt page that the comparison does not read -----------------------------------------------

def _pages(path):
    db = sqlite3.connect(path)
    page_size = db.execute("PRAGMA page_size").fetchone()[0]
    roots = dict(db.execute("SELECT name, rootpage FROM sqlite_master"))
    db.close()
    return page_size, roots


def _corrupt(path, how):
    page_size, roots = _pages(path)
    data = bytearray(path.read_bytes())
    if how == "index":  # a name inside the records_by_name index, same length: the index no longer matches
        start = (roots["records_by_name"] - 1) * page_size
        at = data.index(b"layer.alpha", start, start + page_size)
        data[at:at + 11] = b"layer.alphb"
    elif how == "steps-page":  # the steps table's page header: a cell count the page cannot hold
        start = (roots["steps"] - 1) * page_size
        data[start + 3:start + 5] = b"\xff\xff"
    path.write_bytes(bytes(data))
    if how == "steps-count":  # a steps row that disagrees with the records it counts
        db = sqlite3.connect(path)
        db.execute("UPDATE steps SET n_records = 7 WHERE step = 1")
        db.commit()
        db.close()
    if how == "orphan-record":  # a record of a step that was never committed
        db = sqlite3.connect(path)
        db.execute("INSERT INTO records SELECT 9, seq, phase, name, kind, dtype, shape, digest, rows FROM records "
                   "WHERE step = 0")
        db.commit()
        db.close()


@pytest.mark.parametrize("how", ["index", "steps-page", "steps-count", "orphan-record"])
def test_a_corrupt_trace_is_never_identical(tmp_path, how):
    def trace(path):
        with verify.Recorder(path, run="run") as rec:
            for step in range(3):
                rec.record("layer.alpha", torch.full((4, 2), float(step)), kind="input")
                rec.record("layer.alpha", torch.full((4, 2), float(step + 1)))
                rec.step()
        return path

    good, bad = trace(tmp_path / "good.db"), trace(tmp_path / "bad.db")
    _corrupt(bad, how)
    for a, b in ((bad, good), (good, bad), (bad, bad)):
        with pytest.raises(verify.TraceError, match="bad.db"):
            verify.diff_traces(a, b)
        with pytest.raises(verify.TraceError, match="bad.db"):
            verify.align_by_content(a, b)
        run = CliRunner().invoke(main, ["diff", str(a), str(b)])
        assert run.exit_code == 2 and "bad.db" in run.stderr, run.output
    run = CliRunner().invoke(main, ["report", str(good), "--against", str(bad), "--out", str(tmp_path / "r")])
    assert run.exit_code == 2 and "bad.db" in run.stderr
    assert verify.diff_traces(good, good).identical


# -- 10. NaN in a contract ---------------------------------------------------------------------------

def _strict(text):
    """json.loads that refuses NaN / Infinity (not JSON)."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, [1.0, math.nan], {"k": math.nan}])
def test_non_finite_contract_values_equal_themselves(tmp_path, value):
    contract = {verify.CONTRACT_KEY: {"eps": value, "arch": "x"}}
    a, b = _trace(tmp_path / "a.db", meta=contract), _trace(tmp_path / "b.db", meta=contract)
    assert verify.diff_traces(a, b).identical and verify.align_by_content(a, b).contract_mismatch == {}
    run = CliRunner().invoke(main, ["diff", str(a), str(b), "--json"])
    assert run.exit_code == 0 and _strict(run.stdout)["identical"] is True


def test_non_finite_values_print_as_strict_json(tmp_path):
    a = _trace(tmp_path / "a.db", meta={verify.CONTRACT_KEY: {"eps": math.nan, "z": 0.0}})
    b = _trace(tmp_path / "b.db", meta={verify.CONTRACT_KEY: {"eps": math.inf, "z": -0.0}})
    result = verify.diff_traces(a, b)
    assert sorted(result.contract_mismatch) == ["eps", "z"]  # -0.0 is not 0.0: the JSON texts differ
    for args in (["diff", str(a), str(b), "--json"], ["diff", str(a), str(b), "--json", "--align", "content"]):
        run = CliRunner().invoke(main, args)
        assert run.exit_code == 1
        doc = _strict(run.stdout)
        assert doc["contract_mismatch"]["eps"] == {"a": "NaN", "b": "Infinity"}
    run = CliRunner().invoke(main, ["report", str(a), "--against", str(b), "--out", str(tmp_path / "r")])
    assert run.exit_code == 1
    _strict((tmp_path / "r" / "report.json").read_text())


# -- 11. Ctrl-C is not 'diverged' ----------------------------------------------------------------------

def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("command", ["diff", "checkpoint", "hash", "report", "bisect"])
def test_ctrl_c_exits_130_from_every_command(tmp_path, monkeypatch, command):
    import importlib

    for module, name in (("compare", "diff_traces"), ("checkpoint", "compare_checkpoints"),
                         ("checkpoint", "hash_checkpoint"), ("report", "build_report"), ("bisect", "bisect")):
        # (the module object: `verify.bisect` the attribute is the function once something asked for it)
        monkeypatch.setattr(importlib.import_module(f"verify.{module}"), name, _interrupt)
    trace = _trace(tmp_path / "t.db")
    args = {"diff": ["diff", trace, trace], "checkpoint": ["checkpoint", trace, trace], "hash": ["hash", trace],
            "report": ["report", trace], "bisect": ["bisect", "--good", "a", "--bad", "b", "--cmd", "true"]}[command]
    run = CliRunner().invoke(main, [str(a) for a in args])
    assert run.exit_code == 130, run.output
    assert run.stderr.strip() == "mok-verify: interrupted"


def test_ctrl_c_during_a_real_bisect_exits_130_and_cleans_up(tmp_path):
    import shutil

    if shutil.which("git") is None:
        pytest.skip("needs git")
    from tests.helpers.git_repo import commit_each, new_repo

    repo = tmp_path / "repo"
    git = new_repo(repo)
    revs = commit_each(git, repo, "f", 3)
    pids = tmp_path / "pids"
    proc = subprocess.Popen([sys.executable, "-m", "verify.cli", "bisect", "--repo", str(repo), "--good", revs[0],
                             "--bad", revs[-1], "--cmd", f"sleep 100 & echo $! > {pids}; wait"], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # as a terminal's Ctrl-C finds it: an ignored SIGINT (left by an earlier test's vLLM
                            # engine in this process) would be inherited and Python would never see the signal
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while not (pids.exists() and pids.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "mok-verify: interrupted"
    assert git("worktree", "list").count("\n") == 0
