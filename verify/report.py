"""Reports over traces: per-step digests, per-step content agreement of two traces, metrics, and an
HTML page with PNG plots (`write_report`, `mok-verify report TRACE`).

What a report shows, from the SQLite trace alone (plus a second trace when one is named or found):
- the run (name, metadata, steps, records) and one digest per step (`step_digests`);
- scalar metrics per step (reward, loss, logprob gap, ...) when the writer logged them with
  `log_metrics` into the trace's `metrics` table (a table verify's reader ignores), plotted per step;
- with a second trace: a heat map of per-op, per-step agreement (content alignment of per-row ops
  inside each step: rows matched by input-row digest, output-row digests compared) and the first
  divergence. Two traces of the same run name (a rerun) are compared in execution order
  (`diff_traces`); traces of different runs (trainer vs sampler) by content, step by step.
The second trace is `other`, or else the trace's metadata key `partner` (a path relative to the
trace's folder), which the demo sets on its trainer trace; a partner named but missing is an
InputNotFoundError (exit 2), never a report that compared nothing.

verify knows no op names. Which ops content alignment compares (`names`: globs; only ops whose output
row depends on that row's input alone should be) and the order to list them in (`order`) are
parameters; without them a report takes the globs from the trace's metadata key `aligned_ops` (the
writer's own list, as the demo and rl's vLLM plugin write it), else every op recorded with input and
output rows, listed in the order the ops were first recorded.
"""
from __future__ import annotations

import fnmatch
import html
import io
import json
import math
import numbers
import os
import sqlite3
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import xxhash

from verify.args import as_globs, as_int, as_path, same_file, what_is_at, write_atomically
from verify.compare import _match_rows, _row_map, json_safe
from verify.errors import ArgumentError, InputNotFoundError, TraceError, VerifyError
from verify.store import Trace, opened, records_of_steps

ALIGNED_OPS_KEY = "aligned_ops"
"""Trace metadata key: the globs of the trace's per-row ops, the default `names` of a report."""

_METRICS_SCHEMA = ("CREATE TABLE IF NOT EXISTS metrics (step INTEGER NOT NULL, key TEXT NOT NULL, "
                   "value REAL, PRIMARY KEY (step, key)) WITHOUT ROWID")


# -- metrics ------------------------------------------------------------------------------------------

def log_metrics(trace_path: str | os.PathLike, step: int, values: dict[str, float]) -> None:
    """Store scalar metrics of one step in the trace file's `metrics` table (one transaction).

    Safe while a Recorder writes the same file (SQLite WAL serialises the two writers). step: an int;
    values: a dict of str -> real number or None. Raises ArgumentError for other arguments, the errors
    of `Trace(path)` for a path that is not a verify trace (nothing is written to it).
    """
    step = as_int(step, "log_metrics: step")
    if not isinstance(values, dict) or not all(
            isinstance(k, str) and (v is None or (isinstance(v, numbers.Real) and not isinstance(v, bool)))
            for k, v in values.items()):
        raise ArgumentError(f"log_metrics: values must be a dict of str -> real number (or None), got {values!r}")
    with Trace(trace_path) as trace:  # validates: a path, a verify trace of a readable schema
        path = trace.path
    db = sqlite3.connect(path, timeout=30)
    try:
        db.execute(_METRICS_SCHEMA)
        db.executemany("INSERT OR REPLACE INTO metrics (step, key, value) VALUES (?, ?, ?)",
                       [(step, k, None if v is None else float(v)) for k, v in values.items()])
        db.commit()
    except sqlite3.DatabaseError as e:
        raise TraceError(f"cannot write metrics to {path}: {e}") from None
    finally:
        db.close()


def read_metrics(trace: Trace | str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """key -> [(step, value), ...] in step order; {} when the trace has no metrics table."""
    if isinstance(trace, Trace):
        path = trace.path
    else:
        with Trace(trace) as opened_trace:  # validates: a path, a verify trace of a readable schema
            path = opened_trace.path
    db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        if db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='metrics'").fetchone() is None:
            return {}
        out: dict[str, list[tuple[int, float]]] = {}
        for step, key, value in db.execute("SELECT step, key, value FROM metrics ORDER BY key, step"):
            out.setdefault(key, []).append((step, math.nan if value is None else value))
        return out
    except sqlite3.DatabaseError as e:
        raise TraceError(f"{path}: unreadable metrics table: {e}") from None
    finally:
        db.close()


# -- digests ------------------------------------------------------------------------------------------

def step_digests(trace: Trace | str | os.PathLike, steps: Sequence[int] | None = None) -> dict[int, str]:
    """step -> xxh3-64 hex over that step's records (phase, name, kind, dtype, shape, digest) in order.

    Equal digests mean the step recorded the same events with bitwise-equal tensors.
    """
    hashers: dict[int, xxhash.xxh3_64] = {}
    with opened(trace) as t:
        for r in records_of_steps(t, steps):
            h = hashers.setdefault(r.step, xxhash.xxh3_64())
            h.update(f"{r.phase}\t{r.name}\t{r.kind}\t{r.dtype}\t{list(r.shape)}\t{r.digest}\n".encode())
    return {s: h.hexdigest() for s, h in sorted(hashers.items())}


def trace_digest(trace: Trace | str | os.PathLike, digests: dict[int, str] | None = None) -> str:
    """xxh3-64 hex over all step digests: equal for two runs that recorded bitwise-equal traces.

    digests: `step_digests(trace)` when the caller has it already (saves a second pass over the trace).
    """
    h = xxhash.xxh3_64()
    for step, digest in (step_digests(trace) if digests is None else digests).items():
        h.update(f"{step}:{digest}\n".encode())
    return h.hexdigest()


# -- per-step content agreement ------------------------------------------------------------------------

@dataclass
class OpStepAgreement:
    """One op in one step: distinct input rows present in both traces (matched), how many of those
    have equal output rows (agreeing), rows seen in one trace only, and rows whose output differs
    between two places of the same trace (inconsistent: batch variance)."""

    step: int
    name: str
    matched: int = 0
    agreeing: int = 0
    only_a: int = 0
    only_b: int = 0
    inconsistent_a: int = 0
    inconsistent_b: int = 0
    first_mismatch_row: int | None = None  # row index, in trace A's output record, of the first mismatch

    @property
    def fraction(self) -> float:
        """agreeing / matched, NaN when nothing matched."""
        return self.agreeing / self.matched if self.matched else math.nan

    @property
    def ok(self) -> bool:
        return self.agreeing == self.matched and self.inconsistent_a == 0 and self.inconsistent_b == 0


def _ranks(order: Sequence[str] | None, recorded: Sequence[str]) -> dict[str, tuple[int, int]]:
    """op name -> sort key: its place in `order` (the first entry, name or glob, it matches), else after
    every listed name in the order the names were first recorded (`recorded`)."""
    ranks = {}
    for position, name in enumerate(dict.fromkeys(recorded)):
        listed = next((i for i, entry in enumerate(order or ()) if fnmatch.fnmatchcase(name, entry)), None)
        ranks[name] = (0, listed) if listed is not None else (1, position)
    return ranks


def agreement_by_step(a: Trace | str | os.PathLike, b: Trace | str | os.PathLike,
                      names: Sequence[str] | None = None, steps: Sequence[int] | None = None,
                      order: Sequence[str] | None = None) -> list[OpStepAgreement]:
    """Content alignment inside each step: for every (step, op) recorded by both traces, how many rows
    matched by input content and how many of them agree bitwise. Sorted by step, then `order`.

    Step s of A is compared with step s of B (the demo records one RL step per trace step on both
    sides). names: op-name globs to compare (default: every op recorded with input and output rows;
    only per-row ops give meaningful results); steps: only these steps; order: op names or globs in
    the order to list the ops (default, and for names it does not list: the order in which the ops
    were first recorded, trace A first).
    """
    names, order = as_globs(names, "names"), as_globs(order, "order")
    with opened(a) as ta, opened(b) as tb:
        # Per (step, op) tables; only rows keyed by their input are compared (output-only records are not).
        maps = [{key: entry for key, entry in _row_map(t, names, per_step=True, steps=steps, other=o.sampling).items()
                 if entry[0] == "input"} for t, o in ((ta, tb), (tb, ta))]
    ranks = _ranks(order, [name for _, name in (*maps[0], *maps[1])])
    empty = ("input", {}, set(), 0)
    out = []
    for key in sorted(set(maps[0]) | set(maps[1]), key=lambda k: (k[0], ranks[k[1]])):
        _, rows_a, inc_a, _ = maps[0].get(key, empty)
        _, rows_b, inc_b, _ = maps[1].get(key, empty)
        match = _match_rows(rows_a, rows_b)
        out.append(OpStepAgreement(
            key[0], key[1], matched=match.matched, agreeing=match.matched - match.mismatched,
            only_a=match.only_a, only_b=match.only_b, inconsistent_a=len(inc_a), inconsistent_b=len(inc_b),
            first_mismatch_row=None if match.first_mismatch is None else match.first_mismatch[0][-1]))
    return out


def first_content_divergence(agreement: Sequence[OpStepAgreement]) -> OpStepAgreement | None:
    """The earliest op (by step, then the agreement's order) whose matched rows disagree or that is inconsistent."""
    return next((op for op in agreement if not op.ok), None)


# -- report -------------------------------------------------------------------------------------------

@dataclass
class Report:
    """What `write_report` found; `to_json()` is written next to the HTML page."""

    trace: str
    run: str
    meta: dict
    steps: int
    records: int
    digest: str
    step_digests: dict[int, str]
    metrics: dict[str, list[tuple[int, float]]]
    other: str | None = None
    comparison: str | None = None  # 'order' or 'content'
    aligned_ops: list[str] | None = None  # the globs content alignment compared (None: every op with inputs)
    identical: bool | None = None
    divergence: str | None = None
    divergence_json: dict | None = None
    plots: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        doc = asdict(self)
        doc["step_digests"] = {str(k): v for k, v in self.step_digests.items()}
        doc["metrics"] = {k: [[s, None if math.isnan(v) else v] for s, v in vals] for k, vals in self.metrics.items()}
        return doc


def _aligned_ops(trace: Trace) -> list[str] | None:
    globs = trace.meta.get(ALIGNED_OPS_KEY) if isinstance(trace.meta, dict) else None
    if globs is None:
        return None
    if not isinstance(globs, list) or not all(isinstance(g, str) for g in globs):
        raise TraceError(f"{trace.path}: metadata '{ALIGNED_OPS_KEY}' is not a list of op-name globs")
    return globs


def _partner(trace: Trace) -> Path | None:
    """The trace named by the metadata key `partner` (relative to the trace's folder), or None without one.
    A partner named but absent is an InputNotFoundError: a report never passes it over in silence."""
    partner = trace.meta.get("partner") if isinstance(trace.meta, dict) else None
    if partner is None or partner == "":
        return None
    if not isinstance(partner, str):
        raise TraceError(f"{trace.path}: metadata 'partner' is {json.dumps(partner)}, not a path")
    path = Path(partner)
    path = path if path.is_absolute() else trace.path.parent / path
    if not path.is_file():
        raise InputNotFoundError(f"partner trace not found: {path} (named by the metadata 'partner' of {trace.path}; "
                                 "pass --against to compare with another trace)")
    return path


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise VerifyError("the report needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _png(plt, fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def plot_metrics(metrics: dict[str, list[tuple[int, float]]], title: str = "") -> bytes | None:
    """One PNG: a panel per metric (reward, loss, max logprob gap, ... in that order), value per step."""
    if not metrics:
        return None
    plt = _pyplot()
    preferred = ["reward", "max_logprob_gap", "loss", "routing_agreement"]
    keys = [k for k in preferred if k in metrics] + sorted(k for k in metrics if k not in preferred)
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.2 * len(keys)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        steps = [s for s, _ in metrics[key]]
        values = [v for _, v in metrics[key]]
        ax.plot(steps, values, marker="o", markersize=3)
        ax.set_ylabel(key.replace("_", " "))
        ax.grid(alpha=0.3)
        if key == "max_logprob_gap" and all(v == 0 for v in values):
            ax.set_ylim(-1e-3, 1e-3)
            ax.text(0.5, 0.8, "exactly 0 at every step", transform=ax.transAxes, ha="center", va="center",
                    color="green")
    from matplotlib.ticker import MaxNLocator

    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1, 0].set_xlabel("step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _png(plt, fig)


def plot_agreement(agreement: Sequence[OpStepAgreement], title: str = "") -> bytes | None:
    """A PNG heat map: per-row ops (rows, in the agreement's order) x steps (columns), colour = fraction of
    matched rows that agree bitwise (grey: no row matched)."""
    if not agreement:
        return None
    plt = _pyplot()
    import numpy as np

    names = list(dict.fromkeys(op.name for op in agreement))
    steps = sorted({op.step for op in agreement})
    grid = np.full((len(names), len(steps)), np.nan)  # [ops, steps]
    for op in agreement:
        grid[names.index(op.name), steps.index(op.step)] = op.fraction
    fig, ax = plt.subplots(figsize=(max(6.0, 0.3 * len(steps) + 4.5), max(2.5, 0.28 * len(names) + 1.2)))
    cmap = plt.get_cmap("RdYlGn").with_extremes(bad="lightgrey")
    image = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap=cmap, vmin=0.0, vmax=1.0,
                      interpolation="nearest")
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.set_xticks(range(len(steps)), [str(s) for s in steps], fontsize=7)
    ax.set_xlabel("step")
    fig.colorbar(image, ax=ax, label="rows agreeing bitwise")
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return _png(plt, fig)


def describe_content(op: OpStepAgreement) -> str:
    """One line on a content divergence: how many matched rows differ, or that one trace is inconsistent."""
    if op.matched != op.agreeing:
        text = (f"step {op.step}, {op.name}: {op.matched - op.agreeing} of {op.matched} rows matched by input "
                f"content differ")
        if op.first_mismatch_row is not None:
            text += f" (first: row {op.first_mismatch_row} of trace A's record)"
        return text
    return (f"step {op.step}, {op.name}: the same input row gave different outputs inside one trace "
            f"(inconsistent A/B {op.inconsistent_a}/{op.inconsistent_b}: batch variance)")


def write_report(trace_path: str | os.PathLike, out_dir: str | os.PathLike | None = None,
                 other: str | os.PathLike | None = None, names: Sequence[str] | None = None,
                 order: Sequence[str] | None = None) -> Path:
    """Write `report.html` (+ report.json and PNG plots) for a trace into out_dir; returns the HTML path.

    out_dir: default `<trace stem>_report` next to the trace. other: a second trace to compare with
    (default: the trace's `partner` metadata, if any). names, order: the ops to align by content and
    the order to list them in (see `agreement_by_step`); names default to the trace's `aligned_ops`
    metadata, if any.
    """
    return build_report(trace_path, out_dir, other, names, order)[0]


def build_report(trace_path: str | os.PathLike, out_dir: str | os.PathLike | None = None,
                 other: str | os.PathLike | None = None, names: Sequence[str] | None = None,
                 order: Sequence[str] | None = None) -> tuple[Path, Report]:
    """`write_report`, returning (HTML path, Report): `Report.identical` is False when the comparison
    with the second trace diverged (or compared nothing), None when there was no second trace.
    Raises ArgumentError (an argument of the wrong type), InputNotFoundError, TraceError, VerifyError
    (the output folder cannot be made)."""
    trace_path = as_path(trace_path, "trace")
    out_dir = None if out_dir is None else as_path(out_dir, "out_dir")
    other = None if other is None else as_path(other, "other")
    names, order = as_globs(names, "names"), as_globs(order, "order")
    with Trace(trace_path) as trace:
        trace.check_integrity()
        out = out_dir if out_dir is not None else trace_path.with_name(f"{trace_path.stem}_report")
        steps = trace.steps()
        digests = step_digests(trace)
        report = Report(str(trace_path), trace.run, trace.meta, len(steps), len(trace), trace_digest(trace, digests),
                        digests, read_metrics(trace))
        if names is None:
            names = _aligned_ops(trace)
        report.aligned_ops = None if names is None else list(names)
        other_path = Path(other) if other is not None else _partner(trace)
        if other is not None and not other_path.is_file():
            raise InputNotFoundError(f"trace not found: {other_path}")
        agreement: list[OpStepAgreement] = []
        if other_path is not None:
            report.other = str(other_path)
            with Trace(other_path) as second:
                second.check_integrity()  # no verdict on a corrupt file (diff_traces checks too: once per Trace)
                if second.run == trace.run:
                    from verify.compare import diff_traces

                    report.comparison = "order"
                    result = diff_traces(trace, second)
                    report.identical = result.identical
                    if not result.identical:
                        report.divergence, report.divergence_json = result.describe(), result.to_json()
                else:
                    report.comparison = "content"
                agreement = agreement_by_step(trace, second, names, order=order)
                if report.comparison == "content":
                    first = first_content_divergence(agreement)
                    report.identical = first is None and any(op.matched for op in agreement)
                    if first is not None:
                        report.divergence, report.divergence_json = describe_content(first), asdict(first)
    title = f"{report.run}: {trace_path.name}"
    files = {"metrics.png": plot_metrics(report.metrics, title),
             "agreement.png": plot_agreement(agreement, f"{trace_path.name} vs {Path(report.other).name}"
                                             if report.other else "")}
    report.plots = [name for name, png in files.items() if png is not None]
    files["report.json"] = json.dumps(json_safe(report.to_json()), indent=1, allow_nan=False) + "\n"
    files["report.html"] = _html(report, agreement)  # last: a page that exists describes the files beside it
    inputs = [trace_path] + ([Path(report.other)] if report.other else [])
    for name in files:  # every output checked before any is written: a refused report changes nothing
        there = what_is_at(out / name)
        if there not in (None, "a regular file"):
            raise VerifyError(f"cannot write {out / name}: it is {there}")
        for source in inputs:
            if same_file(out / name, source):
                raise VerifyError(f"refusing to write {out / name}: it is the trace {source} the report reads")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise VerifyError(f"cannot create {out}: {e.strerror}") from None
    for name, data in files.items():
        if data is not None:
            write_atomically(out / name, data)
    return out / "report.html", report


def _html(report: Report, agreement: Sequence[OpStepAgreement]) -> str:
    e = html.escape
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>mok-verify report: {e(report.run)}</title>",
        "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}td,th{padding:2px 8px;text-align:left}"
        "table{border-collapse:collapse}tr:nth-child(even){background:#f4f4f4}code,pre{background:#f0f0f0}"
        ".ok{color:green}.bad{color:#b00}</style></head><body>",
        f"<h1>mok-verify report: {e(report.run)}</h1>",
        "<table>",
        f"<tr><th>trace</th><td><code>{e(report.trace)}</code></td></tr>",
        f"<tr><th>steps</th><td>{report.steps}</td></tr>",
        f"<tr><th>records</th><td>{report.records}</td></tr>",
        f"<tr><th>trace digest</th><td><code>{e(report.digest)}</code></td></tr>",
        f"<tr><th>metadata</th><td><code>{e(json.dumps(report.meta, sort_keys=True))}</code></td></tr>",
        "</table>",
    ]
    if report.other is not None:
        verdict = ("<span class='ok'>identical</span>" if report.identical
                   else "<span class='bad'>diverged</span>" if report.identical is False else "nothing to compare")
        parts += [f"<h2>Comparison with <code>{e(report.other)}</code> ({e(report.comparison or '')})</h2>",
                  f"<p>Verdict: {verdict}</p>"]
        if report.divergence:
            parts.append(f"<p>First divergence:</p><pre>{e(report.divergence)}</pre>")
    for plot in report.plots:
        parts.append(f"<h2>{e(plot[:-4])}</h2><img src='{e(plot)}' alt='{e(plot)}'>")
    if report.metrics:
        keys = sorted(report.metrics)
        by_step: dict[int, dict[str, float]] = {}
        for key in keys:
            for step, value in report.metrics[key]:
                by_step.setdefault(step, {})[key] = value
        parts.append("<h2>Metrics per step</h2><table><tr><th>step</th>"
                     + "".join(f"<th>{e(k)}</th>" for k in keys) + "<th>step digest</th></tr>")
        for step in sorted(by_step):
            cells = "".join(f"<td>{by_step[step].get(k, math.nan):.6g}</td>" for k in keys)
            parts.append(f"<tr><td>{step}</td>{cells}<td><code>{e(report.step_digests.get(step, ''))}</code></td></tr>")
        parts.append("</table>")
    else:
        parts.append("<h2>Step digests</h2><table><tr><th>step</th><th>digest</th></tr>")
        parts += [f"<tr><td>{s}</td><td><code>{e(d)}</code></td></tr>" for s, d in report.step_digests.items()]
        parts.append("</table>")
    if agreement:
        compared = ("every op recorded with input rows" if report.aligned_ops is None
                    else ", ".join(f"<code>{e(g)}</code>" for g in report.aligned_ops))
        parts.append("<h2>Per-op agreement (content alignment)</h2><p>Rows of each per-row op are matched "
                     "across the two traces by the digest of their input row, then their output rows are compared. "
                     "An op with no matched rows (grey in the heat map) saw inputs that already differ "
                     f"upstream. Ops compared: {compared}.</p><table><tr><th>step</th><th>op</th>"
                     "<th>matched rows</th><th>agreeing</th><th>only A</th><th>only B</th></tr>")
        for op in agreement:
            cls = "ok" if op.ok else "bad"
            parts.append(f"<tr class='{cls}'><td>{op.step}</td><td>{e(op.name)}</td><td>{op.matched}</td>"
                         f"<td>{op.agreeing}</td><td>{op.only_a}</td><td>{op.only_b}</td></tr>")
        parts.append("</table>")
    parts.append("</body></html>\n")
    return "\n".join(parts)
