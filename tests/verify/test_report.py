"""verify.report: per-step digests, per-step content agreement, metrics, and the HTML/PNG report
(library and `mok-verify report`). Traces are written with verify.Recorder from plain torch tensors; the
op names are made up (verify knows none of rl's)."""
from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

import verify
from verify.cli import main as cli
from verify.report import (
    agreement_by_step,
    first_content_divergence,
    log_metrics,
    read_metrics,
    step_digests,
    trace_digest,
    write_report,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
OPS = ("layers.0.input_norm", "layers.0.moe", "layers.1.moe", "lm_head")


def _write(path, run, rows_TH, steps=2, flip=None, meta=None, permute=False):
    """A trace of `steps` steps; each op maps its input rows to output rows with a fixed per-op function.

    flip=(step, op, row): change that output row in this trace only.
    permute: record each step's rows in reverse order (another batch layout, same content).
    """
    with verify.Recorder(path, run=run, meta=meta or {}) as rec:
        for step in range(steps):
            x_TH = rows_TH + step
            if permute:
                x_TH = x_TH.flip(0)
            for index, name in enumerate(OPS):
                y_TH = (x_TH * (index + 2) + 1).to(torch.bfloat16)
                if flip is not None and flip[:2] == (step, name):
                    row = flip[2] if not permute else x_TH.shape[0] - 1 - flip[2]
                    y_TH[row, 0] = 12345.0 if y_TH[row, 0] != 12345.0 else 0.0
                rec.record(name, x_TH, kind="input")
                rec.record(name, y_TH, kind="output")
                x_TH = y_TH.float()
            rec.record("logprobs", x_TH.sum(-1), kind="output")
            rec.step(param_grads=False)
    return path


@pytest.fixture
def rows_TH():
    return torch.randn(7, 13, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("steps", [1, 3])
def test_identical_traces_agree_everywhere_and_share_digests(tmp_path, rows_TH, steps):
    a = _write(tmp_path / "a.db", "trainer", rows_TH, steps)
    b = _write(tmp_path / "b.db", "sampler", rows_TH, steps, permute=True)
    ops = agreement_by_step(a, b)
    assert {(op.step, op.name) for op in ops} == {(s, n) for s in range(steps) for n in OPS}
    for op in ops:
        assert (op.matched, op.agreeing, op.only_a, op.only_b) == (7, 7, 0, 0)
        assert op.ok and op.fraction == 1.0
    assert first_content_divergence(ops) is None
    # Same content in another row order: the per-step digests differ (they are bitwise, order included).
    assert step_digests(a) != step_digests(b)
    c = _write(tmp_path / "c.db", "trainer", rows_TH, steps)
    assert step_digests(a) == step_digests(c) and trace_digest(a) == trace_digest(c)
    assert sorted(step_digests(a)) == list(range(steps))


def test_a_changed_row_is_found_at_its_step_op_and_row(tmp_path, rows_TH):
    a = _write(tmp_path / "a.db", "trainer", rows_TH, 3)
    b = _write(tmp_path / "b.db", "sampler", rows_TH, 3, flip=(1, "layers.0.moe", 4))
    ops = {(op.step, op.name): op for op in agreement_by_step(a, b)}
    bad = ops[(1, "layers.0.moe")]
    assert (bad.matched, bad.agreeing, bad.first_mismatch_row) == (7, 6, 4)
    # Downstream of the changed row, that row's input no longer matches: 6 matched, 1 only in each.
    after = ops[(1, "layers.1.moe")]
    assert (after.matched, after.agreeing, after.only_a, after.only_b) == (6, 6, 1, 1)
    assert all(op.ok for key, op in ops.items() if key[0] != 1 or key[1] == "layers.0.input_norm")
    first = first_content_divergence(list(ops.values()))
    assert (first.step, first.name) == (1, "layers.0.moe")
    assert step_digests(a)[0] == step_digests(b)[0] and step_digests(a)[1] != step_digests(b)[1]


def test_batch_variance_inside_one_trace_is_flagged(tmp_path, rows_TH):
    a = _write(tmp_path / "a.db", "trainer", rows_TH, 1)
    path = tmp_path / "b.db"
    with verify.Recorder(path, run="sampler") as rec:
        y_TH = (rows_TH * 3 + 1).to(torch.bfloat16)
        rec.record("layers.0.moe", rows_TH, kind="input")
        rec.record("layers.0.moe", y_TH, kind="output")
        y2_TH = y_TH.clone()
        y2_TH[2] += 1  # the same input row, computed again in another batch, gives other bits
        rec.record("layers.0.moe", rows_TH[:3], kind="input")
        rec.record("layers.0.moe", y2_TH[:3], kind="output")
        rec.step(param_grads=False)
    (op,) = [op for op in agreement_by_step(a, path) if op.name == "layers.0.moe"]
    assert (op.inconsistent_a, op.inconsistent_b) == (0, 1) and not op.ok
    assert first_content_divergence([op]) is op


def test_metrics_round_trip_and_absent_table(tmp_path, rows_TH):
    a = _write(tmp_path / "a.db", "trainer", rows_TH, 2)
    assert read_metrics(a) == {}
    log_metrics(a, 0, {"reward": 0.25, "max_logprob_gap": 0.0})
    log_metrics(a, 1, {"reward": 0.5, "max_logprob_gap": 0.0, "loss": float("nan")})
    log_metrics(a, 1, {"reward": 0.75})  # replaces
    metrics = read_metrics(a)
    assert metrics["reward"] == [(0, 0.25), (1, 0.75)]
    assert metrics["max_logprob_gap"] == [(0, 0.0), (1, 0.0)]
    assert math.isnan(metrics["loss"][0][1])
    # The trace stays a valid verify trace with the same records.
    assert len(verify.Trace(a)) == 2 * (2 * len(OPS) + 1)
    with pytest.raises(verify.InputNotFoundError):
        log_metrics(tmp_path / "missing.db", 0, {"x": 1.0})


def test_report_with_partner_writes_html_pngs_and_the_first_divergence(tmp_path, rows_TH):
    _write(tmp_path / "sampler.db", "sampler", rows_TH, 3, flip=(2, "layers.1.moe", 0))
    a = _write(tmp_path / "trainer.db", "trainer", rows_TH, 3, meta={"partner": "sampler.db", "seed": 5})
    for step, reward in enumerate([0.1, 0.2, 0.4]):
        log_metrics(a, step, {"reward": reward, "max_logprob_gap": 0.0, "loss": -0.01 * step})
    page = write_report(a, tmp_path / "rep")
    assert page == tmp_path / "rep" / "report.html"
    for png in ("metrics.png", "agreement.png"):
        assert (tmp_path / "rep" / png).read_bytes()[:8] == PNG_MAGIC
    text = page.read_text()
    assert "<img src='metrics.png'" in text and "<img src='agreement.png'" in text
    assert "diverged" in text and "step 2, layers.1.moe: 1 of 7 rows" in text
    doc = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert doc["comparison"] == "content" and doc["identical"] is False
    assert doc["divergence_json"]["name"] == "layers.1.moe" and doc["divergence_json"]["step"] == 2
    assert doc["metrics"]["reward"] == [[0, 0.1], [1, 0.2], [2, 0.4]]
    assert doc["digest"] == trace_digest(a) and doc["steps"] == 3 and doc["meta"]["seed"] == 5


def test_report_of_a_rerun_compares_in_execution_order(tmp_path, rows_TH):
    a = _write(tmp_path / "a.db", "train", rows_TH, 2)
    same = _write(tmp_path / "same.db", "train", rows_TH, 2)
    other = _write(tmp_path / "other.db", "train", rows_TH, 2, flip=(1, "lm_head", 6))
    doc = json.loads(write_report(a, tmp_path / "r1", other=same).with_name("report.json").read_text())
    assert doc["comparison"] == "order" and doc["identical"] is True and doc["divergence"] is None
    page = write_report(a, tmp_path / "r2", other=other)
    doc = json.loads(page.with_name("report.json").read_text())
    assert doc["identical"] is False
    assert doc["divergence_json"]["divergence"]["a"]["name"] == "lm_head"
    assert doc["divergence_json"]["divergence"]["rows"] == [6]


def test_report_of_a_lone_trace_without_metrics(tmp_path, rows_TH):
    a = _write(tmp_path / "a.db", "train", rows_TH, 2)
    page = write_report(a)  # default folder beside the trace
    assert page == tmp_path / "a_report" / "report.html"
    doc = json.loads(page.with_name("report.json").read_text())
    assert doc["plots"] == [] and doc["other"] is None and doc["identical"] is None
    assert all(d in page.read_text() for d in step_digests(a).values())


def test_cli_report(tmp_path, rows_TH):
    b = _write(tmp_path / "b.db", "sampler", rows_TH, 2)
    a = _write(tmp_path / "a.db", "trainer", rows_TH, 2)
    run = CliRunner().invoke(cli, ["report", str(a), "--out", str(tmp_path / "out"), "--against", str(b)])
    assert run.exit_code == 0, run.output
    assert run.stdout.strip() == str(tmp_path / "out" / "report.html")
    assert (tmp_path / "out" / "agreement.png").read_bytes()[:8] == PNG_MAGIC
    assert "identical" in (tmp_path / "out" / "report.html").read_text()
    for args in ([str(tmp_path / "missing.db")], [str(a), "--against", str(tmp_path / "missing.db")]):
        run = CliRunner().invoke(cli, ["report", *args])
        assert run.exit_code == 2
        assert "trace not found" in run.output and "Traceback" not in run.output
    # A diverged comparison (here the partner named in the metadata) still writes the page, and exits 1.
    _write(tmp_path / "flipped.db", "sampler", rows_TH, 2, flip=(1, "layers.0.moe", 3))
    c = _write(tmp_path / "c.db", "trainer", rows_TH, 2, meta={"partner": "flipped.db"})
    run = CliRunner().invoke(cli, ["report", str(c), "--out", str(tmp_path / "out_c")])
    assert run.exit_code == 1, run.output
    assert run.stdout.strip() == str(tmp_path / "out_c" / "report.html")
    assert json.loads((tmp_path / "out_c" / "report.json").read_text())["identical"] is False
    run = CliRunner().invoke(cli, ["report", str(a), "--out", str(tmp_path / "out_lone")])  # no second trace
    assert run.exit_code == 0, run.output
    not_a_trace = tmp_path / "text.db"
    not_a_trace.write_text("hello\n" * 20)
    run = CliRunner().invoke(cli, ["report", str(not_a_trace)])
    assert run.exit_code == 2 and "not a verify trace" in run.output


def test_ops_and_their_order_are_parameters(tmp_path, rows_TH):
    """verify knows no op names: the caller says which ops to align and in which order to list them;
    by default every op with input rows, in the order first recorded."""
    a = _write(tmp_path / "a.db", "trainer", rows_TH, 2)
    b = _write(tmp_path / "b.db", "sampler", rows_TH, 2, permute=True)
    assert [op.name for op in agreement_by_step(a, b) if op.step == 0] == list(OPS)  # recorded order
    picked = agreement_by_step(a, b, ["layers.*.moe", "lm_head"])
    assert [(op.step, op.name) for op in picked] == [(s, n) for s in range(2) for n in OPS[1:]]
    reordered = agreement_by_step(a, b, order=["lm_head", "layers.1.moe"])  # the rest follow, as recorded
    assert [op.name for op in reordered if op.step == 1] == ["lm_head", "layers.1.moe", "layers.0.input_norm",
                                                             "layers.0.moe"]


def test_report_aligns_the_ops_the_trace_names(tmp_path, rows_TH):
    """Without `names`, a report aligns the globs of the trace's `aligned_ops` metadata; `names` wins."""
    _write(tmp_path / "sampler.db", "sampler", rows_TH, 2, flip=(1, "layers.0.moe", 2))
    meta = {"partner": "sampler.db", "aligned_ops": ["layers.*.input_norm", "lm_head"]}
    a = _write(tmp_path / "trainer.db", "trainer", rows_TH, 2, meta=meta)
    doc = json.loads(write_report(a, tmp_path / "r1").with_name("report.json").read_text())
    assert doc["aligned_ops"] == meta["aligned_ops"]
    assert doc["identical"] is True  # the changed op is not among those the trace names
    doc = json.loads(write_report(a, tmp_path / "r2", names=["layers.*"]).with_name("report.json").read_text())
    assert doc["identical"] is False and doc["divergence_json"]["name"] == "layers.0.moe"
    run = CliRunner().invoke(cli, ["report", str(a), "--out", str(tmp_path / "r3"), "--name", "layers.0.*"])
    assert run.exit_code == 1, run.output
    assert json.loads((tmp_path / "r3" / "report.json").read_text())["aligned_ops"] == ["layers.0.*"]
    bad = _write(tmp_path / "bad.db", "trainer", rows_TH, 1, meta={"partner": "sampler.db", "aligned_ops": "moe"})
    run = CliRunner().invoke(cli, ["report", str(bad), "--out", str(tmp_path / "r4")])
    assert run.exit_code == 2 and "aligned_ops" in run.output


@pytest.mark.parametrize("input_name", ["report.json", "report.html", "metrics.png", "agreement.png"])
@pytest.mark.parametrize("side", ["trace", "against"])
def test_a_report_never_writes_over_a_trace_it_reads(tmp_path, rows_TH, input_name, side):
    out = tmp_path / "out"
    out.mkdir()
    a = _write(tmp_path / "a.db", "trainer", rows_TH, 2)
    b = _write(tmp_path / "b.db", "sampler", rows_TH, 2)
    read = out / input_name
    (a if side == "trace" else b).rename(read)
    trace, against = (read, b) if side == "trace" else (a, read)
    before = read.read_bytes()
    run = CliRunner().invoke(cli, ["report", str(trace), "--against", str(against), "--out", str(out)])
    assert run.exit_code == 2 and f"refusing to write {read}" in run.stderr, run.output
    assert read.read_bytes() == before
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(input_name)) == []  # nothing else written


def test_a_report_that_cannot_write_one_file_writes_none(tmp_path, rows_TH):
    a = _write(tmp_path / "a.db", "trainer", rows_TH, 2)
    b = _write(tmp_path / "b.db", "sampler", rows_TH, 2)
    out = tmp_path / "out"
    (out / "report.html").mkdir(parents=True)
    run = CliRunner().invoke(cli, ["report", str(a), "--against", str(b), "--out", str(out)])
    assert run.exit_code == 2 and run.stderr.strip().endswith("report.html: it is a directory"), run.output
    assert [p.name for p in out.iterdir()] == ["report.html"]
    run = CliRunner().invoke(cli, ["report", str(a), "--against", str(tmp_path / "missing.db"),
                                   "--out", str(tmp_path / "never")])
    assert run.exit_code == 2 and not (tmp_path / "never").exists()  # no folder for a report that failed
