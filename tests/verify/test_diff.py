"""mok-verify diff: first divergence in execution order, and content alignment of per-row ops."""
import json

import pytest
import torch
from click.testing import CliRunner

import verify
from verify.cli import main

# torch warns when a hooked module's inputs do not require grad (the first module here); expected.
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")


class RowWise(torch.nn.Module):
    """A per-row op made of exactly rounded element-wise ops, so it is batch-invariant on the CPU."""

    def __init__(self, h: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.scale = torch.nn.Parameter(torch.randn(h, generator=g))
        self.shift = torch.nn.Parameter(torch.randn(h, generator=g))

    def forward(self, x):
        return x * self.scale + self.shift


def make_model():
    return torch.nn.Sequential(RowWise(8, 1), torch.nn.Tanh(), RowWise(8, 2))


def record_run(path, batches, perturb=None):
    model = make_model()
    if perturb is not None:
        perturb(model)
    with verify.Recorder(path) as rec:
        rec.attach(model, types=RowWise)
        for x in batches:
            model(x).sum().backward()
            rec.step()
            model.zero_grad()
    return path


def batches(n_steps=2, rows=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, 8, generator=g) for _ in range(n_steps)]


def run_cli(*args):
    result = CliRunner().invoke(main, list(map(str, args)))
    return result.exit_code, result.stdout, result.stderr


def test_identical_runs(tmp_path):
    a = record_run(tmp_path / "a.db", batches())
    b = record_run(tmp_path / "b.db", batches())
    result = verify.diff_traces(a, b)
    assert result.identical and result.compared == len(verify.Trace(a))
    code, out, _ = run_cli("diff", a, b, "--json")
    assert code == 0 and json.loads(out)["identical"] is True


def test_first_divergence_names_step_record_and_rows(tmp_path):
    data_a = batches()
    data_b = [x.clone() for x in data_a]
    data_b[1][[1, 4], 3] += 1e-3  # step 1, rows 1 and 4 of the input
    a = record_run(tmp_path / "a.db", data_a)
    b = record_run(tmp_path / "b.db", data_b)
    want_rows = (data_a[1] != data_b[1]).any(-1).nonzero().flatten().tolist()
    result = verify.diff_traces(a, b)
    d = result.divergence
    assert (d.reason, d.a["step"], d.a["seq"], d.a["phase"], d.a["name"], d.a["kind"]) == (
        "digest", 1, 0, "forward", "0", "input")
    assert d.rows == want_rows == [1, 4] and d.n_rows_differ == 2 and d.n_rows == 6
    # Everything of step 0 was compared before it.
    with verify.Trace(a) as trace:
        assert result.compared == trace.steps()[0][1]
    code, out, _ = run_cli("diff", a, b, "--json")
    doc = json.loads(out)
    assert code == 1 and doc["divergence"]["rows"] == [1, 4] and doc["divergence"]["a"]["name"] == "0"
    code, out, _ = run_cli("diff", a, b)
    assert code == 1 and "step 1" in out and "rows differing: 2 of 6: [1, 4]" in out


def test_parameter_change_shows_at_the_first_module_it_affects(tmp_path):
    def bump(model):
        with torch.no_grad():
            model[2].shift[5] += 1.0  # changes layer 2's output, and only its column 5
    a = record_run(tmp_path / "a.db", batches(1))
    b = record_run(tmp_path / "b.db", batches(1), perturb=bump)
    d = verify.diff_traces(a, b).divergence
    assert (d.a["name"], d.a["kind"], d.a["phase"]) == ("2", "output", "forward")
    assert d.n_rows_differ == 6


@pytest.mark.parametrize("change, reason", [
    (lambda rec: rec.record("extra", torch.ones(3)), "missing_in_a"),
    (lambda rec: rec.record("x", torch.ones(3, dtype=torch.float64)), "dtype"),
    (lambda rec: rec.record("x", torch.ones(1, 3)), "shape"),
    (lambda rec: rec.record("y", torch.ones(3)), "event"),
])
def test_structural_divergences(tmp_path, change, reason):
    with verify.Recorder(tmp_path / "a.db") as rec:
        rec.record("x", torch.ones(3))
    with verify.Recorder(tmp_path / "b.db") as rec:
        if reason == "missing_in_a":
            rec.record("x", torch.ones(3))
        change(rec)
    d = verify.diff_traces(tmp_path / "a.db", tmp_path / "b.db").divergence
    assert d is not None and d.reason == reason
    assert run_cli("diff", tmp_path / "a.db", tmp_path / "b.db")[0] == 1


def op(x):
    return x * 3.0 - 1.0


def record_op(path, batches, tweak_row=None):
    with verify.Recorder(path) as rec:
        for x in batches:
            y = op(x)
            if tweak_row is not None and (x == tweak_row).all(-1).any():
                i = int((x == tweak_row).all(-1).nonzero()[0])
                y[i, 0] = y[i, 0] + 1.0
            rec.record("layers.0.moe", x, kind="input")
            rec.record("layers.0.moe", y, kind="output")
            rec.record("layers.0.attention", torch.cumsum(x, 0), kind="output")
            rec.step()
    return path


def test_content_alignment_matches_rows_across_batchings(tmp_path):
    tokens = torch.randn(7, 8, generator=torch.Generator().manual_seed(3))
    trainer = record_op(tmp_path / "trainer.db", [tokens[:5], tokens[5:]])
    # The sampler sees the same rows as a prefill of 3 and single-row decode steps, out of order,
    # plus one row the trainer never saw.
    extra = torch.randn(1, 8, generator=torch.Generator().manual_seed(4))
    pieces = [tokens[[4, 0, 2]], tokens[1:2], tokens[6:7], tokens[3:4], tokens[5:6], extra]
    sampler = record_op(tmp_path / "sampler.db", pieces)
    assert not verify.diff_traces(trainer, sampler).identical  # execution order differs ...
    result = verify.align_by_content(trainer, sampler)  # ... but every shared row agrees
    ops = {o.name: o for o in result.ops}
    moe = ops["layers.0.moe"]
    assert (moe.keyed_by, moe.matched, moe.mismatched, moe.only_a, moe.only_b) == ("input", 7, 0, 0, 1)
    # attention records only outputs (and is not per-row): its rows are looked up, never "mismatched".
    assert ops["layers.0.attention"].keyed_by == "output" and ops["layers.0.attention"].mismatched == 0
    assert result.identical
    code, out, _ = run_cli("diff", trainer, sampler, "--align", "content", "--json")
    json_ops = {o["name"]: o for o in json.loads(out)["ops"]}
    assert code == 0 and json_ops["layers.0.moe"]["matched"] == 7

    bad = record_op(tmp_path / "bad.db", pieces, tweak_row=tokens[3])
    result = verify.align_by_content(trainer, bad, names=["layers.*.moe"])
    (moe,) = result.ops
    assert (moe.matched, moe.mismatched) == (7, 1) and not result.identical
    # tokens[3] is row 3 of the trainer's first step; in the sampler it is step 3 (seq 4: 3 records per step + 1).
    assert moe.first_mismatch == {"a": [0, 1, 3], "b": [3, 1, 0]}
    code, out, _ = run_cli("diff", trainer, bad, "--align", "content", "--name", "layers.*.moe")
    assert code == 1 and "mismatched 1" in out and "DIFFERS" in out


def test_content_alignment_flags_batch_variance_inside_one_trace(tmp_path):
    row = torch.randn(1, 8, generator=torch.Generator().manual_seed(5))
    with verify.Recorder(tmp_path / "v.db") as rec:
        for out_shift in (0.0, 1e-3):  # the same input row, two different outputs
            rec.record("norm", row, kind="input")
            rec.record("norm", op(row) + out_shift, kind="output")
            rec.step()
    result = verify.align_by_content(tmp_path / "v.db", tmp_path / "v.db")
    assert result.ops[0].inconsistent_a == 1 and not result.identical


def test_output_only_ops_are_found_by_output_row(tmp_path):
    table = torch.randn(10, 8, generator=torch.Generator().manual_seed(6))
    with verify.Recorder(tmp_path / "a.db") as rec:
        rec.record("embed", table[[1, 2, 3, 4]])
    with verify.Recorder(tmp_path / "b.db") as rec:
        rec.record("embed", table[[3, 1]])
        rec.step()
        rec.record("embed", table[[9]])
    (embed,) = verify.align_by_content(tmp_path / "a.db", tmp_path / "b.db").ops
    assert (embed.keyed_by, embed.matched, embed.mismatched, embed.only_a, embed.only_b) == ("output", 2, 0, 2, 1)


def test_content_alignment_with_nothing_to_align_is_not_identical(tmp_path):
    with verify.Recorder(tmp_path / "n.db") as rec:
        rec.record("logits", torch.ones(2, 3))
    result = verify.align_by_content(tmp_path / "n.db", tmp_path / "n.db")
    assert not result.identical and result.ops[0].keyed_by == "output"
    assert run_cli("diff", tmp_path / "n.db", tmp_path / "n.db", "--align", "content")[0] == 1


def _two_op_trace(path, x_TF, between, first=lambda x: x * 2):
    """op `first` (x -> x * 2), then untraced code `between`, then op `second` (y -> y + 1)."""
    with verify.Recorder(path) as rec:
        y_TF = first(x_TF)
        rec.record("first", x_TF, kind="input")
        rec.record("first", y_TF, kind="output")
        z_TF = between(y_TF)
        rec.record("second", z_TF, kind="input")
        rec.record("second", z_TF + 1, kind="output")
        rec.step(param_grads=False)


def test_rows_that_stop_matching_on_both_sides_are_a_divergence(tmp_path):
    x_TF = torch.randn(40, 16)
    _two_op_trace(tmp_path / "a.db", x_TF, lambda y: y.sigmoid())
    _two_op_trace(tmp_path / "b.db", x_TF, lambda y: y.sigmoid() * (1 + 2 ** -20))  # untraced code differs
    result = verify.align_by_content(tmp_path / "a.db", tmp_path / "b.db")
    second = next(op for op in result.ops if op.name == "second")
    assert not result.identical and result.first_mismatch is second
    assert (second.stopped_matching, second.after, second.mismatched) == (40, "first", 0)
    assert "diverged between first and second" in result.describe()
    run = CliRunner().invoke(main, ["diff", "--align", "content", str(tmp_path / "a.db"), str(tmp_path / "b.db")])
    assert run.exit_code == 1


def test_rows_one_side_runs_at_one_op_only_are_not_a_divergence(tmp_path):
    x_TF = torch.randn(40, 16)
    _two_op_trace(tmp_path / "all.db", x_TF, lambda y: y.sigmoid())
    _two_op_trace(tmp_path / "last.db", x_TF, lambda y: y.sigmoid()[-5:])  # an lm_head over last positions only
    for a, b in (("all.db", "last.db"), ("last.db", "all.db")):
        result = verify.align_by_content(tmp_path / a, tmp_path / b)
        assert result.identical, result.describe()


def _rows_changed(rows, factor=1 + 2 ** -20):
    def between(y_TF):
        z_TF = y_TF.sigmoid()
        z_TF[rows] = z_TF[rows] * factor
        return z_TF
    return between


def test_a_few_rows_that_stop_matching_are_a_divergence(tmp_path):
    """3 rows of 40 diverge in untraced code: each is followed from `first` (matched) to `second` (no partner on
    either side), however few they are."""
    x_TF = torch.randn(40, 16)
    _two_op_trace(tmp_path / "a.db", x_TF, lambda y: y.sigmoid())
    _two_op_trace(tmp_path / "b.db", x_TF, _rows_changed([4, 17, 39]))
    result = verify.align_by_content(tmp_path / "a.db", tmp_path / "b.db")
    second = next(op for op in result.ops if op.name == "second")
    assert (second.stopped_matching, second.after, second.mismatched) == (3, "first", 0)
    assert not result.identical and "diverged between first and second" in result.describe()


def test_rows_each_side_runs_alone_are_not_a_divergence(tmp_path):
    """A's extra row repeats row 0's input to `first` but reaches `second` with other content (a trainer's last
    position, whose context the sampler never ran); B's extra row repeats row 5's and reaches `second` as junk
    (CUDA-graph padding). Each loses its partner on one side only."""
    x_TF = torch.randn(40, 16)
    last_TF, pad_TF = torch.cat([x_TF, x_TF[:1]]), torch.cat([x_TF, x_TF[5:6]])
    _two_op_trace(tmp_path / "a.db", last_TF, _rows_changed([40], factor=3.0))
    _two_op_trace(tmp_path / "b.db", pad_TF, _rows_changed([40], factor=-7.0))
    result = verify.align_by_content(tmp_path / "a.db", tmp_path / "b.db")
    second = next(op for op in result.ops if op.name == "second")
    assert (second.only_a, second.only_b, second.stopped_matching) == (1, 1, 0)
    assert result.identical, result.describe()


def test_a_traced_ops_own_mismatch_is_not_also_a_loss_after_it(tmp_path):
    x_TF = torch.randn(40, 16)
    _two_op_trace(tmp_path / "a.db", x_TF, lambda y: y.sigmoid())
    _two_op_trace(tmp_path / "b.db", x_TF, lambda y: y.sigmoid(),
                  first=lambda x: torch.cat([x[:7] * 2, x[7:8] * 2 * (1 + 2 ** -20), x[8:] * 2]))
    result = verify.align_by_content(tmp_path / "a.db", tmp_path / "b.db")
    first, second = (next(op for op in result.ops if op.name == name) for name in ("first", "second"))
    assert (first.mismatched, second.stopped_matching) == (1, 0)
    assert result.first_mismatch is first
