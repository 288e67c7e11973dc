"""mok-verify command line: the subcommands exist, and every kind of bad input gives one clear line
on stderr, exit code 2 and no traceback."""
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

import verify
from verify.cli import main
from verify.store import SCHEMA_VERSION

REPO = Path(__file__).resolve().parents[2]


def test_help_lists_the_subcommands():
    run = CliRunner().invoke(main, ["--help"])
    assert run.exit_code == 0
    commands = run.stdout.split("Commands:")[1]
    for name in ["diff", "checkpoint", "hash", "bisect"]:
        assert f"  {name} " in commands


@pytest.fixture
def files(tmp_path):
    good_trace = tmp_path / "good.db"
    with verify.Recorder(good_trace) as rec:
        rec.record("x", torch.ones(2, 3))
    not_sqlite = tmp_path / "not_sqlite.db"
    not_sqlite.write_text("hello, I am text\n" * 10)
    foreign = tmp_path / "foreign.db"
    db = sqlite3.connect(foreign)
    db.execute("CREATE TABLE t (a)")
    db.commit()
    db.close()
    future = tmp_path / "future.db"
    with verify.Recorder(future) as rec:
        rec.record("x", torch.ones(2, 3))
    db = sqlite3.connect(future)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    good_st = tmp_path / "good.safetensors"
    save_file({"w": torch.randn(16, 16), "b": torch.zeros(4)}, good_st)
    data = good_st.read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[:-100])
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + data[24:])
    bad_manifest = tmp_path / "manifest.json"
    bad_manifest.write_text("{ this is not json")
    other_json = tmp_path / "other.json"
    other_json.write_text(json.dumps({"hello": 1}))
    bad_index_dir = tmp_path / "sharded"
    bad_index_dir.mkdir()
    index = {"weight_map": {"w": "missing.safetensors"}}
    (bad_index_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    not_ckpt = tmp_path / "model.pt"
    not_ckpt.write_bytes(b"\x00garbage" * 50)
    torch.save({"w": torch.eye(2).to_sparse()}, tmp_path / "sparse.pt")
    (tmp_path / "a_folder").mkdir()
    os.mkfifo(tmp_path / "fifo.db")
    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
    return {p.name: p for p in tmp_path.iterdir()} | {"missing": tmp_path / "missing.db"}


BAD_INPUTS = [
    ("diff", "missing", "good.db", "not found"),
    ("diff", "good.db", "not_sqlite.db", "not a verify trace"),
    ("diff", "foreign.db", "good.db", "not a verify trace"),
    ("diff", "good.db", "future.db", f"schema version {SCHEMA_VERSION + 1}"),
    ("checkpoint", "missing", "good.safetensors", "not found"),
    ("checkpoint", "good.safetensors", "truncated.safetensors", "not a readable safetensors"),
    ("checkpoint", "corrupt.safetensors", "good.safetensors", "not a readable safetensors"),
    ("checkpoint", "good.safetensors", "manifest.json", "not valid JSON"),
    ("checkpoint", "other.json", "good.safetensors", "not a verify manifest"),
    ("checkpoint", "good.safetensors", "sharded", "shard listed in the index is missing"),
    ("checkpoint", "model.pt", "good.safetensors", "not a readable torch checkpoint"),
    ("hash", "truncated.safetensors", None, "not a readable safetensors"),
    ("hash", "missing", None, "not found"),
    ("diff", "a_folder", "good.db", "a_folder is a directory, not a trace"),
    ("diff", "good.db", "fifo.db", "fifo.db is a FIFO, not a trace"),
    ("diff", "loop_a", "good.db", "loop_a is a symlink loop, not a trace"),
    ("report", "a_folder", None, "is a directory, not a trace"),
    ("checkpoint", "sparse.pt", "good.safetensors", "tensor 'w' is a sparse_coo tensor"),
]


@pytest.mark.parametrize("command, a, b, message", BAD_INPUTS, ids=[f"{c}-{a}-{b}" for c, a, b, _ in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_2(files, command, a, b, message):
    args = [command, str(files[a])] + ([str(files[b])] if b else [])
    run = CliRunner().invoke(main, args)
    assert run.exit_code == 2, run.output
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mok-verify: error: ") and message in lines[0], run.stderr
    assert "Traceback" not in run.output and run.stdout == ""


def test_bad_bisect_input(tmp_path):
    args = ["bisect", "--repo", str(tmp_path / "nope"), "--good", "a", "--bad", "b", "--cmd", "true"]
    run = CliRunner().invoke(main, args)
    assert run.exit_code == 2 and run.stderr.startswith("mok-verify: error: repository not found")
    assert len(run.stderr.splitlines()) == 1


USAGE_ERRORS = [
    (["diff", "a.db", "b.db", "--bogus"], "No such option '--bogus'"),
    (["bogus"], "No such command 'bogus'"),
    (["--bogus"], "No such option '--bogus'"),
    (["report", "a.db", "--name"], "'--name' requires an argument"),
    (["bisect", "--repo", ".", "--good", "a", "--bad", "b", "--cmd", "true", "--timeout", "-1"], "--timeout"),
    (["diff", "a.db", "b.db", "--name", "x*"], "it needs --align content"),
]


@pytest.mark.parametrize("args, message", USAGE_ERRORS, ids=[" ".join(a) for a, _ in USAGE_ERRORS])
def test_a_usage_error_is_one_line_and_exit_2(args, message):
    run = CliRunner().invoke(main, args)
    assert run.exit_code == 2, run.output
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mok-verify: error: ") and message in lines[0], run.stderr


def test_bisect_of_a_file_says_it_is_not_a_repository(files):
    run = CliRunner().invoke(main, ["bisect", "--repo", str(files["good.db"]), "--good", "a", "--bad", "b",
                                    "--cmd", "true"])
    assert run.exit_code == 2 and "is a regular file, not a git repository" in run.stderr
    assert len(run.stderr.splitlines()) == 1


def test_two_traces_that_share_no_record_prove_nothing(tmp_path):
    for name in ("a.db", "b.db"):
        with verify.Recorder(tmp_path / name):
            pass
    run = CliRunner().invoke(main, ["diff", str(tmp_path / "a.db"), str(tmp_path / "b.db")])
    assert run.exit_code == 1 and "nothing was compared" in run.stdout
    assert not verify.diff_traces(tmp_path / "a.db", tmp_path / "b.db").identical


def test_real_process_exit_codes_and_stderr(files):
    # Through the interpreter, as a user would run it: no traceback, one line, exit 2.
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-m", "verify.cli", "diff", str(files["good.db"]), str(files["not_sqlite.db"])]
    proc = subprocess.run(args,
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and "not a verify trace" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "verify.cli", "diff", str(files["good.db"]), str(files["good.db"])],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and proc.stdout.startswith("identical: 1 records")
