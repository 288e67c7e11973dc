"""verify.Recorder and trace files: what hooks record (order, names, phases, digests), selection,
the direct API, crash safety with a real SIGKILLed process, and the trace format checks."""
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import verify
from verify.errors import InputNotFoundError, RecorderError, SchemaVersionError, TraceError
from verify.store import APPLICATION_ID, SCHEMA_VERSION, Trace

REPO = Path(__file__).resolve().parents[2]


class Block(torch.nn.Module):
    def __init__(self, h: int, i: int):
        super().__init__()
        self.up = torch.nn.Linear(h, i)
        self.act = torch.nn.ReLU()
        self.down = torch.nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(Block(6, 10), Block(6, 10))


def test_hooks_record_forward_backward_and_param_grads(tmp_path):
    model = make_model()
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with verify.Recorder(tmp_path / "t.db", run="unit", meta={"seed": 0}) as rec:
        rec.attach(model, include=["*.up", "*.down"])
        model(x).square().sum().backward()
        assert rec.step() == 0

    # Recompute every expected tensor in plain torch.
    model2 = make_model()
    x2 = x.detach().clone().requires_grad_(True)
    h0 = model2[0].up(x2)
    a0 = torch.relu(h0)
    o0 = model2[0].down(a0)
    h1 = model2[1].up(o0)
    a1 = torch.relu(h1)
    o1 = model2[1].down(a1)
    grads = torch.autograd.grad(o1.square().sum(), [h0, a0, o0, h1, a1, o1, x2, *model2.parameters()])
    g_h0, g_a0, g_o0, g_h1, g_a1, g_o1, g_x = grads[:7]
    grads = grads[2:]
    p = dict(zip([n for n, _ in model2.named_parameters()], grads[5:]))
    fp = verify.fingerprint
    expected = [
        ("forward", "0.up", "input", fp(x2)), ("forward", "0.up", "output", fp(h0)),
        ("forward", "0.down", "input", fp(a0)), ("forward", "0.down", "output", fp(o0)),
        ("forward", "1.up", "input", fp(o0)), ("forward", "1.up", "output", fp(h1)),
        ("forward", "1.down", "input", fp(a1)), ("forward", "1.down", "output", fp(o1)),
        ("backward", "1.down.grad_output", "grad", fp(g_o1)), ("backward", "1.down.grad_input", "grad", fp(g_a1)),
        ("backward", "1.up.grad_output", "grad", fp(g_h1)), ("backward", "1.up.grad_input", "grad", fp(g_o0)),
        ("backward", "0.down.grad_output", "grad", fp(g_o0)), ("backward", "0.down.grad_input", "grad", fp(g_a0)),
        ("backward", "0.up.grad_output", "grad", fp(g_h0)), ("backward", "0.up.grad_input", "grad", fp(g_x)),
        ("after_backward", "0.up.weight", "param", fp(p["0.up.weight"])),
        ("after_backward", "0.up.bias", "param", fp(p["0.up.bias"])),
        ("after_backward", "0.down.weight", "param", fp(p["0.down.weight"])),
        ("after_backward", "1.up.weight", "param", fp(p["1.up.weight"])),
        ("after_backward", "1.up.bias", "param", fp(p["1.up.bias"])),
        ("after_backward", "1.down.weight", "param", fp(p["1.down.weight"])),
    ]
    with Trace(tmp_path / "t.db") as trace:
        assert trace.run == "unit" and trace.meta == {"seed": 0}
        records = list(trace.records())
        assert trace.steps() == [(0, len(expected), True)]
    assert [(r.phase, r.name, r.kind, r.digest) for r in records] == expected
    assert [r.seq for r in records] == list(range(len(expected)))
    first = records[1]
    assert first.shape == (5, 10) and first.dtype == "float32"
    assert first.row_digests().tolist() == verify.row_fingerprints(h0).tolist()


def test_selection_by_glob_regex_and_type(tmp_path):
    model = make_model()
    x = torch.randn(3, 6)
    cases = {
        "glob": dict(include="1.*"),
        "regex": dict(include="re:\\d\\.(up|act)"),
        "type": dict(types=torch.nn.ReLU),
        "both": dict(include=["0", "0.*"], types=(torch.nn.Linear,)),
        "root": dict(include="*", types=torch.nn.Sequential),
    }
    want = {"glob": {"1.up", "1.act", "1.down"}, "regex": {"0.up", "0.act", "1.up", "1.act"},
            "type": {"0.act", "1.act"}, "both": {"0.up", "0.down"}, "root": {""}}
    for label, kwargs in cases.items():
        path = tmp_path / f"{label}.db"
        with verify.Recorder(path) as rec:
            handle = rec.attach(model, backward=False, **kwargs)
            model(x)
            rec.step()
            handle.remove()
            model(x)  # after remove(): nothing more is recorded
        with Trace(path) as trace:
            assert {r.name for r in trace.records()} == want[label], label
            assert len(trace) == 2 * len(want[label])
    with verify.Recorder(tmp_path / "none.db") as rec, pytest.raises(RecorderError, match="selected no module"):
        rec.attach(model, include="nope*")


def test_direct_record_and_mok_hooks_observer(tmp_path):
    from mok import hooks

    a, b = torch.randn(4, 3), torch.arange(6, dtype=torch.int32)
    with verify.Recorder(tmp_path / "d.db") as rec:
        rec.record("logits", a)
        with hooks.observe(lambda name, t, kind: rec.record(name, t, kind=kind)):
            hooks.emit("layers.0.moe", b, "input")
            hooks.emit("layers.0.moe", a, "output")
        rec.record("no_rows", a, rows=False)
        rec.step()
        rec.record("w", a, kind="param")  # committed by close(), as step 1
        with pytest.raises(RecorderError, match="unknown kind"):
            rec.record("x", a, kind="weights")
    with Trace(tmp_path / "d.db") as trace:
        got = [(r.step, r.name, r.kind, r.phase, r.digest, r.rows is None) for r in trace.records()]
        assert trace.steps() == [(0, 4, True), (1, 1, True)]
    fa, fb = verify.fingerprint(a), verify.fingerprint(b)
    assert got == [(0, "logits", "output", "forward", fa, False), (0, "layers.0.moe", "input", "forward", fb, False),
                   (0, "layers.0.moe", "output", "forward", fa, False), (0, "no_rows", "output", "forward", fa, True),
                   (1, "w", "param", "after_backward", fa, False)]


def test_exception_keeps_step_in_flight_marked_incomplete(tmp_path):
    with pytest.raises(ValueError):
        with verify.Recorder(tmp_path / "e.db") as rec:
            rec.record("a", torch.ones(2))
            rec.step()
            rec.record("b", torch.zeros(2))
            raise ValueError("boom")
    with Trace(tmp_path / "e.db") as trace:
        assert trace.steps() == [(0, 1, True), (1, 1, False)]


def _record_steps(rec: verify.Recorder, steps: int) -> None:
    from tests.helpers.killed_writer import step_tensors

    for step in range(steps):
        for i, t in enumerate(step_tensors(step)):
            rec.record(f"t{i}", t, kind="output")
        rec.step()


@pytest.mark.parametrize("row_every", [1, 3])
def test_background_writing_stores_the_same_trace(tmp_path, row_every):
    traces = {}
    for background in (False, True):
        path = tmp_path / f"b{background}.db"
        with verify.Recorder(path, background=background, row_every=row_every) as rec:
            _record_steps(rec, 5)
            rec.flush()
            with Trace(path) as trace:  # flushed: every step handed over is committed
                assert [s for s, _, _ in trace.steps()] == list(range(5))
            _record_steps(rec, 2)  # committed by close()
        with Trace(path) as trace:
            traces[background] = [(r.key, r.digest, r.rows, r.row_index) for r in trace.records()]
    assert len(traces[True]) == 14 and traces[True] == traces[False]


def test_background_write_error_surfaces_at_the_next_step_and_at_close(tmp_path):
    """A write that fails in the writer process (the trace is locked by another connection: SQLite gives up after its
    5 s busy wait) is lost and raised at the next step; the writer goes on with the steps after it."""
    import sqlite3

    path = tmp_path / "f.db"
    rec = verify.Recorder(path, background=True)
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # holds the write lock
    rec.record("a", torch.ones(2))
    rec.step()  # handed over; the write fails in the writer process
    rec.record("a", torch.ones(2))
    with pytest.raises(RecorderError, match="database is locked"):
        rec.step()
    blocker.execute("ROLLBACK")
    blocker.close()
    rec.record("a", torch.ones(2))
    rec.step()
    rec.close()
    with Trace(path) as trace:
        assert [s for s, _, _ in trace.steps()] == [2] and trace.closed


def test_a_dead_writer_process_is_a_recorder_error_at_the_next_step_and_at_close(tmp_path):
    rec = verify.Recorder(tmp_path / "d.db", background=True)
    rec.record("a", torch.ones(2))
    rec.step()
    rec.flush()
    rec._writer._proc.kill()
    rec._writer._proc.wait()
    rec.record("a", torch.ones(2))
    rec.step()  # handed over to a writer that is gone
    with pytest.raises(RecorderError, match="writer process of trace .* exited"):
        rec.flush()
    with pytest.raises(RecorderError, match="writer process of trace .* exited"):
        rec.close()
    with Trace(tmp_path / "d.db") as trace:  # what it committed is kept
        assert [s for s, _, _ in trace.steps()] == [0] and not trace.closed


def test_background_must_be_a_flag(tmp_path):
    with pytest.raises(RecorderError, match="background"):
        verify.Recorder(tmp_path / "x.db", background="yes")


def test_refuses_to_overwrite_unless_asked(tmp_path):
    path = tmp_path / "o.db"
    with verify.Recorder(path) as rec:
        rec.record("a", torch.ones(2))
    with pytest.raises(RecorderError, match="already exists"):
        verify.Recorder(path)
    with verify.Recorder(path, overwrite=True, run="second") as rec:
        pass
    with Trace(path) as trace:
        assert trace.run == "second" and len(trace) == 0


@pytest.mark.parametrize("background", [False, True], ids=["inline", "background"])
@pytest.mark.parametrize("loop", [False, True], ids=["killed-while-idle", "killed-while-writing"])
def test_sigkill_leaves_completed_steps_readable(tmp_path, loop, background):
    """Inline, every step whose step() returned is kept; in the background, all but the one being written."""
    from tests.helpers.killed_writer import step_tensors

    path = tmp_path / "k.db"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
    args = [sys.executable, str(REPO / "tests/helpers/killed_writer.py"), str(path), "3"]
    args += (["--loop"] if loop else []) + (["--background"] if background else [])
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env)
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line.strip())
            if line.strip() == "in flight" or (loop and line.strip() == "committed 20"):
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert Path(f"{path}-wal").exists()  # the writer never closed cleanly
    with Trace(path) as trace:
        steps = trace.steps()
        committed = [s for s, _, _ in steps]
        handed_over = 21 if loop else 3
        assert committed == list(range(len(committed))) and len(committed) >= handed_over - background
        if not loop:
            assert len(committed) <= 3  # the step in flight is lost
        for step, n_records, complete in steps:
            records = list(trace.records(step=step))
            assert complete and n_records == len(records) == 2
            assert [r.digest for r in records] == [verify.fingerprint(t) for t in step_tensors(step)]


def test_trace_format_checks(tmp_path):
    with pytest.raises(InputNotFoundError):
        Trace(tmp_path / "missing.db")
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(TraceError, match="not a verify trace"):
        Trace(junk)
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("CREATE TABLE x (a)").connection.close()
    with pytest.raises(TraceError, match="not a verify trace"):
        Trace(other)
    newer = tmp_path / "newer.db"
    with verify.Recorder(newer) as rec:
        rec.record("a", torch.ones(2))
    db = sqlite3.connect(newer)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(SchemaVersionError, match=f"version {SCHEMA_VERSION + 1}"):
        Trace(newer)
    assert sqlite3.connect(newer).execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID


def test_a_recorder_dropped_without_close_frees_its_trace_for_the_next(tmp_path):
    """A background Recorder with a capture tap, dropped without close(): its writer process ends and its claim on the
    trace goes with it once it is collected (the tap holds no reference back to the recorder)."""
    import gc

    rec = verify.Recorder(tmp_path / "g.db", background=True, names="x*")
    rec.capture("cpu", capacity=64)
    del rec
    gc.collect()
    with verify.Recorder(tmp_path / "g.db", overwrite=True) as again:
        again.record("x", torch.ones(2))
