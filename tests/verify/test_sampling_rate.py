"""The rate setting of a trace (verify/sampling.py): Recorder(every=N) records steps 0, N, 2N, ...;
row_every=M keeps the row digests of the rows whose key digest is 0 mod M; the setting is stored in
the trace, and diff / content alignment compare what both sides recorded, saying so."""
from __future__ import annotations

import json
import sqlite3

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import verify
from verify.cli import main
from verify.errors import RecorderError, TraceError
from verify.sampling import ROW_RULE


def _batch(step: int, rows: int = 64) -> torch.Tensor:
    return torch.randn(rows, 8, generator=torch.Generator().manual_seed(step))


def _run(path, steps: int = 12, change=None, **rate) -> None:
    """One record pair per step: an op's input and its output (a per-row op: out = 2x + 1).
    change: (step, row) whose output is altered by one ulp-sized amount."""
    with verify.Recorder(path, run="run", **rate) as rec:
        for step in range(steps):
            x = _batch(step)
            out = 2 * x + 1
            if change is not None and change[0] == step:
                out[change[1], 0] += 1e-3
            rec.record("op", x, kind="input")
            rec.record("op", out, kind="output")
            rec.step()


def _kept(x: torch.Tensor, m: int) -> np.ndarray:
    return np.flatnonzero(verify.row_fingerprints(x).numpy() % np.uint64(m) == 0)


def test_every_records_exactly_the_multiples_and_hooks_cost_nothing_between(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    calls = []
    with verify.Recorder(tmp_path / "t.db", every=3) as rec:
        rec.attach(model)
        for step in range(10):
            original = rec.record
            rec.record = lambda *a, _o=original, **k: (calls.append(rec.current_step), _o(*a, **k))
            assert rec.recording == (step % 3 == 0)
            model(_batch(step)).sum().backward()
            rec.record = original
            rec.step()
    with verify.Trace(tmp_path / "t.db") as trace:
        assert [s for s, _, _ in trace.steps()] == [0, 3, 6, 9]
        assert {r.step for r in trace.records()} == {0, 3, 6, 9}
        assert {r.kind for r in trace.records(step=3)} == {"input", "output", "grad", "param"}
    assert set(calls) == {0, 3, 6, 9}  # the hooks of skipped steps never reach record()


def test_the_setting_is_stored_in_the_trace(tmp_path):
    _run(tmp_path / "t.db", steps=2, every=2, row_every=4)
    with verify.Trace(tmp_path / "t.db") as trace:
        assert trace.sampling == {"every": 2, "row_every": 4, "rule": ROW_RULE}
    db = sqlite3.connect(tmp_path / "t.db")
    stored = json.loads(db.execute("SELECT value FROM run WHERE key = 'sampling'").fetchone()[0])
    db.close()
    assert stored == {"every": 2, "row_every": 4, "rule": ROW_RULE}
    _run(tmp_path / "whole.db", steps=1)
    with verify.Trace(tmp_path / "whole.db") as trace:
        assert trace.sampling["every"] == trace.sampling["row_every"] == 1


def test_row_every_keeps_the_documented_rows_and_outputs_follow_their_input(tmp_path):
    for name in ("a.db", "b.db"):
        _run(tmp_path / name, steps=3, row_every=4)
    with verify.Trace(tmp_path / "a.db") as a, verify.Trace(tmp_path / "b.db") as b:
        records_a, records_b = list(a.records()), list(b.records())
    for ra, rb in zip(records_a, records_b):
        assert ra.rows == rb.rows and ra.row_index == rb.row_index  # reproducible
    for step in range(3):
        x = _batch(step)
        inp, out = [r for r in records_a if r.step == step]
        expected = _kept(x, 4)
        assert 0 < len(expected) < len(x)
        assert inp.row_indices().tolist() == expected.tolist()
        assert out.row_indices().tolist() == expected.tolist()  # the input's rows, not its own choice
        assert np.array_equal(inp.row_digests(), verify.row_fingerprints(x).numpy()[expected])
        assert np.array_equal(out.row_digests(), verify.row_fingerprints(2 * x + 1).numpy()[expected])
        assert inp.digest == verify.fingerprint(x)  # the whole-tensor digest still covers every row


def test_two_runs_with_the_same_setting_are_identical(tmp_path):
    _run(tmp_path / "a.db", every=2, row_every=4)
    _run(tmp_path / "b.db", every=2, row_every=4)
    result = verify.diff_traces(tmp_path / "a.db", tmp_path / "b.db")
    assert result.identical and result.compared == 12  # 6 steps x 2 records
    assert "every 2 steps, 1 row in 4 by content" in result.describe()
    assert verify.align_by_content(tmp_path / "a.db", tmp_path / "b.db").identical


def test_a_change_in_a_recorded_step_is_caught_kept_row_or_not(tmp_path):
    _run(tmp_path / "a.db", every=2, row_every=4)
    kept = _kept(_batch(4), 4)
    dropped = next(i for i in range(64) if i not in kept)
    _run(tmp_path / "kept.db", every=2, row_every=4, change=(4, int(kept[0])))
    _run(tmp_path / "dropped.db", every=2, row_every=4, change=(4, dropped))
    caught = verify.diff_traces(tmp_path / "a.db", tmp_path / "kept.db")
    assert not caught.identical and caught.divergence.reason == "digest"
    assert caught.divergence.a["step"] == 4 and caught.divergence.rows == [int(kept[0])]
    assert not verify.align_by_content(tmp_path / "a.db", tmp_path / "kept.db").identical
    # A row the rate did not keep: the whole-tensor digest still differs; no row can be named.
    unnamed = verify.diff_traces(tmp_path / "a.db", tmp_path / "dropped.db")
    assert not unnamed.identical and unnamed.divergence.rows == []
    assert "rows the rate did not keep" in unnamed.describe()


def test_a_change_in_a_skipped_step_is_not_caught(tmp_path):
    """Documented: the rate trades coverage for cost; step 3 is not recorded with every=2."""
    _run(tmp_path / "a.db", every=2)
    _run(tmp_path / "b.db", every=2, change=(3, 0))
    assert verify.diff_traces(tmp_path / "a.db", tmp_path / "b.db").identical


def test_diff_across_settings_compares_the_intersection_and_says_so(tmp_path):
    _run(tmp_path / "two.db", every=2)
    _run(tmp_path / "three.db", every=3, row_every=4)
    result = verify.diff_traces(tmp_path / "two.db", tmp_path / "three.db")
    assert result.identical and result.compared == 4  # steps 0 and 6, two records each
    text = result.describe()
    assert "A every 2 steps, all rows; B every 3 steps, 1 row in 4 by content" in text
    assert "compared only the steps, names and rows both recorded" in text
    assert result.to_json()["sampling_note"] == result.sampling_note
    # Step 3 is B's alone and step 4 A's alone: no divergence. Step 6 both recorded: caught.
    _run(tmp_path / "three_changed_3.db", every=3, row_every=4, change=(3, 0))
    assert verify.diff_traces(tmp_path / "two.db", tmp_path / "three_changed_3.db").identical
    row = int(_kept(_batch(6), 4)[1])
    _run(tmp_path / "three_changed_6.db", every=3, row_every=4, change=(6, row))
    caught = verify.diff_traces(tmp_path / "two.db", tmp_path / "three_changed_6.db")
    assert caught.divergence.a["step"] == 6 and caught.divergence.rows == [row]
    assert caught.divergence.n_rows == len(_kept(_batch(6), 4))
    # Content alignment: the sampled side's rows are found among all of the whole side's.
    content = verify.align_by_content(tmp_path / "two.db", tmp_path / "three.db")
    assert content.identical and "sampling: A every 2 steps" in content.describe()


def test_whole_traces_say_nothing_about_sampling(tmp_path):
    _run(tmp_path / "a.db", steps=2)
    _run(tmp_path / "b.db", steps=3)
    result = verify.diff_traces(tmp_path / "a.db", tmp_path / "b.db")
    assert result.sampling_note is None and result.divergence.reason == "missing_in_a"  # unchanged


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", None])
@pytest.mark.parametrize("key", ["every", "row_every"])
def test_bad_settings_raise_the_typed_error(tmp_path, key, bad):
    with pytest.raises(RecorderError, match=key):
        verify.Recorder(tmp_path / "t.db", **{key: bad})
    assert not (tmp_path / "t.db").exists()


def test_a_malformed_stored_setting_is_a_trace_error_and_exit_2(tmp_path):
    _run(tmp_path / "t.db", steps=1, every=2)
    db = sqlite3.connect(tmp_path / "t.db")
    db.execute("UPDATE run SET value = ? WHERE key = 'sampling'", (json.dumps({"every": 0, "row_every": 1}),))
    db.commit()
    db.close()
    with pytest.raises(TraceError, match="sampling"):
        verify.Trace(tmp_path / "t.db")
    run = CliRunner().invoke(main, ["diff", str(tmp_path / "t.db"), str(tmp_path / "t.db")])
    assert run.exit_code == 2 and "sampling" in run.stderr


def test_content_alignment_trainer_vs_sampler_with_rows_sampled(tmp_path):
    """rl's trainer and sampler batch the same tokens differently; rows chosen by content still pair."""
    rl = pytest.importorskip("rl")
    from mok import hooks
    from rl import trace_names
    from rl.testing import tiny_model

    model = rl.wrap(tiny_model("qwen3_moe", seed=21))
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (3, 7, 5, 9, 2, 6)]

    def record(path, fn, **rate):
        with verify.Recorder(path, run=path.stem, **rate) as rec:
            with hooks.observe(lambda name, tensor, kind: rec.record(name, tensor, kind=kind)):
                out = fn()
            rec.step(param_grads=False)
        return out

    generation = record(tmp_path / "sampler.db", lambda: rl.generate(model, prompts, 3, seed=5, batch_size=4),
                        row_every=4)
    input_ids, attention_mask, _ = generation.padded(left=True)
    record(tmp_path / "trainer.db", lambda: rl.logprobs(model, input_ids, attention_mask), row_every=4)
    record(tmp_path / "whole.db", lambda: rl.logprobs(model, input_ids, attention_mask))
    names = list(trace_names.per_row_globs())
    for trainer in ("trainer.db", "whole.db"):
        result = verify.align_by_content(tmp_path / trainer, tmp_path / "sampler.db", names=names)
        assert result.identical, result.describe()
        moe = next(op for op in result.ops if op.name == "layers.0.moe")
        assert moe.matched > 0 and moe.only_b == 0, moe  # every row the sampler kept, the trainer has


def test_vllm_worker_tracer_takes_the_rate_from_the_environment(tmp_path, monkeypatch):
    from mok.errors import UnsupportedError
    from rl.vllm.trace import WorkerTracer

    monkeypatch.setenv("MOK_TRACE_EVERY", "2")
    monkeypatch.setenv("MOK_TRACE_ROW_EVERY", "3")
    tracer = WorkerTracer(str(tmp_path / "sampler.db"))
    tracer.close_forward_after("lm_head")
    for forward in range(5):
        tracer.begin_forward()  # vLLM's runner, before each forward of served requests
        tracer("lm_head", _batch(forward), "output")
    tracer.close()
    with verify.Trace(tracer.path) as trace:
        assert [s for s, _, _ in trace.steps()] == [0, 2, 4]
        assert (trace.sampling["every"], trace.sampling["row_every"]) == (2, 3)
        assert next(trace.records()).row_indices().tolist() == _kept(_batch(0), 3).tolist()
    for value in ("0", "-1", "x", "1.5"):
        monkeypatch.setenv("MOK_TRACE_ROW_EVERY", value)
        with pytest.raises(UnsupportedError, match="MOK_TRACE_ROW_EVERY"):
            WorkerTracer(str(tmp_path / "other.db"))


def _layers(path, names=None, change=None, steps=2) -> None:
    """A 3-layer toy of two chained per-row ops a layer (`layers.{i}.input_norm`, `layers.{i}.moe`), each recorded
    with its input and output. change: (step, name) whose output moves one row by 1e-3."""
    with verify.Recorder(path, run="run", names=names) as rec:
        for step in range(steps):
            h = _batch(step)
            for layer in range(3):
                for op, fn in (("input_norm", lambda t: 2 * t + 1), ("moe", lambda t: t * 0.5)):
                    name, out = f"layers.{layer}.{op}", fn(h)
                    if change == (step, name):
                        out[5, 0] += 1e-3
                    rec.record(name, h, kind="input")
                    rec.record(name, out, kind="output")
                    h = out
            rec.step()


def test_names_record_only_the_matching_names_and_are_stored(tmp_path):
    _layers(tmp_path / "n.db", names=["layers.*.input_norm"])
    with verify.Trace(tmp_path / "n.db") as trace:
        assert trace.sampling["names"] == ["layers.*.input_norm"]
        assert {r.name for r in trace.records()} == {f"layers.{i}.input_norm" for i in range(3)}
        assert [r.seq for r in trace.records(step=1)] == list(range(6))  # numbered among what is recorded
    with verify.Recorder(tmp_path / "tap.db", names="layers.*.input_norm") as rec:
        tap = rec.capture("cpu", capacity=64)
        tap("layers.0.moe", torch.ones(2, 4), "output")  # left out: nothing appended, nothing to harvest
        assert not tap.holds_entries()
        tap("layers.0.input_norm", torch.ones(2, 4), "output")
        assert tap.holds_entries()


def test_a_change_in_an_op_left_out_shows_at_the_next_recorded_name(tmp_path):
    """A light trace (each layer's input norm) against a whole one: identical when nothing changed; a change in an
    op it leaves out (layer 1's moe) is named at the next name it records (layer 2's norm input), by diff and by
    content alignment, and the sampling line says what was compared."""
    _layers(tmp_path / "whole.db")
    _layers(tmp_path / "light.db", names=["layers.*.input_norm"])
    _layers(tmp_path / "light-changed.db", names=["layers.*.input_norm"], change=(1, "layers.1.moe"))
    same = verify.diff_traces(tmp_path / "whole.db", tmp_path / "light.db")
    assert same.divergence is None and same.compared == 2 * 3 * 2  # steps x layers x (input, output)
    assert "names layers.*.input_norm" in same.sampling_note and "compared only the steps, names" in same.sampling_note
    changed = verify.diff_traces(tmp_path / "whole.db", tmp_path / "light-changed.db")
    assert changed.divergence.reason == "digest"
    assert (changed.divergence.a["step"], changed.divergence.a["name"], changed.divergence.a["kind"]) == (
        1, "layers.2.input_norm", "input")
    content = verify.align_by_content(tmp_path / "whole.db", tmp_path / "light-changed.db")
    assert [op.name for op in content.ops] == [f"layers.{i}.input_norm" for i in range(3)]
    assert [op.mismatched for op in content.ops] == [0, 0, 0]  # the changed row's input has no partner at layer 2:
    assert (content.ops[2].stopped_matching, content.ops[2].after) == (1, "layers.1.input_norm")  # it stops matching


@pytest.mark.parametrize("bad", [[], "", [""], 3, ["a", 2]])
def test_bad_names_raise_the_typed_error(tmp_path, bad):
    with pytest.raises(RecorderError, match="names"):
        verify.Recorder(tmp_path / "t.db", names=bad)
    assert not (tmp_path / "t.db").exists()


def test_vllm_worker_tracer_records_only_the_names_set_and_still_ends_its_forwards(tmp_path, monkeypatch):
    """MOK_TRACE_NAMES leaves the closing op (logprobs) out of the trace, yet that op still commits the forward."""
    from rl.vllm.trace import WorkerTracer

    monkeypatch.setenv("MOK_TRACE_NAMES", "layers.*.input_norm,lm_head")
    tracer = WorkerTracer(str(tmp_path / "sampler.db"))
    tracer.close_forward_after("logprobs")
    for forward in range(3):
        tracer.begin_forward()
        for name in ("layers.0.input_norm", "layers.0.moe", "lm_head", "logprobs"):
            tracer(name, _batch(forward), "output")
    with verify.Trace(tracer.path) as trace:  # committed by logprobs, before close()
        assert [s for s, _, _ in trace.steps()] == [0, 1, 2]
        assert [r.name for r in trace.records(step=2)] == ["layers.0.input_norm", "lm_head"]
        assert trace.sampling["names"] == ["layers.*.input_norm", "lm_head"]
    tracer.close()
