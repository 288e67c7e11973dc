"""Trace comparison: the first divergence in execution order, and content alignment of per-row ops.

Both first compare the traces' execution contracts (run metadata `execution_contract`, a flat JSON object of what
decides the bits; see `contract_difference`): differing keys are reported first and make the traces not identical.
`diff_traces(a, b)` walks both traces in (step, seq) order and stops at the first record that differs (event,
dtype, shape or digest, or one trace ending early); with row digests on both sides it says which rows differ.
`align_by_content(a, b)` ignores execution order and batch layout: for each op name it pairs every input record
with the next output record of that name in the same step, maps input-row digest -> output-row digest, and
compares the output rows of inputs seen in both traces. Only meaningful for pure per-row ops (the MoE layer,
norms, linears): a row's output must depend on that row alone.
Traces recorded at a rate (verify/sampling.py) are compared on what both recorded (steps and rows), and the result
says which setting each side had (`sampling_note`).
"""
from __future__ import annotations

import fnmatch
import json
import math
import os
from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass, field
from itertools import zip_longest

import numpy as np

from verify import sampling
from verify.args import as_globs
from verify.store import Record, Trace, opened, records_of_steps

_MAX_LISTED_ROWS = 32


@dataclass
class Divergence:
    """The first point where two traces differ.

    reason: 'event' (different step/phase/name/kind at this position), 'dtype', 'shape', 'digest',
    'missing_in_a' or 'missing_in_b' (one trace ended). rows: indices of differing rows (up to 32
    listed) when both records carry row digests; n_rows_differ / n_rows count them all (n_rows: the
    rows both sides kept, when either recorded only some).
    """

    position: int
    reason: str
    a: dict | None
    b: dict | None
    rows: list[int] | None = None
    n_rows_differ: int | None = None
    n_rows: int | None = None
    sampled: bool = False

    def describe(self) -> str:
        where = self.a or self.b
        lines = [f"first divergence at record {self.position} (step {where['step']}, seq {where['seq']}): "
                 f"{where['phase']} {where['name']} [{where['kind']}] — {_REASONS[self.reason]}"]
        if self.reason == "event":
            lines.append(f"  A: {_event(self.a)}")
            lines.append(f"  B: {_event(self.b)}")
        elif self.reason in ("dtype", "shape"):
            lines.append(f"  A: {self.a['dtype']} {self.a['shape']}   B: {self.b['dtype']} {self.b['shape']}")
        elif self.reason == "digest":
            if self.rows is None:
                lines.append("  rows: not recorded on both sides")
            else:
                more = " ..." if self.n_rows_differ > len(self.rows) else ""
                lines.append(f"  rows differing: {self.n_rows_differ} of {self.n_rows}"
                             f"{' rows both kept' if self.sampled else ''}: {self.rows}{more}"
                             + (" (the change is in rows the rate did not keep)"
                                if self.sampled and not self.n_rows_differ else ""))
        return "\n".join(lines)


_REASONS = {
    "event": "the traces record different events here",
    "dtype": "dtype differs",
    "shape": "shape differs",
    "digest": "contents differ",
    "missing_in_a": "trace A ended; B has more records",
    "missing_in_b": "trace B ended; A has more records",
}


def _event(record: dict | None) -> str:
    if record is None:
        return "(end of trace)"
    return f"step {record['step']} seq {record['seq']} {record['phase']} {record['name']} [{record['kind']}]"


def _summary(record: Record | None) -> dict | None:
    if record is None:
        return None
    return {"step": record.step, "seq": record.seq, "phase": record.phase, "name": record.name,
            "kind": record.kind, "dtype": record.dtype, "shape": list(record.shape), "digest": record.digest}


class _Absent:
    """The value of a contract key that one side lacks (not JSON null: that is a value)."""

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT = _Absent()
"""Stands for a contract key missing on one side in `contract_mismatch` tuples."""


def contract_difference(trace_a: Trace, trace_b: Trace) -> tuple[dict[str, tuple], str | None]:
    """(mismatch, note) of two traces' execution contracts (metadata `execution_contract`).

    mismatch: key -> (value in A, value in B) for every key whose values differ, a key absent on one
    side given as `ABSENT`; empty when both sides agree or either side has no contract. note: which
    side has no contract, as a sentence, when exactly one side has one; else None.
    """
    contract_a, contract_b = trace_a.contract, trace_b.contract
    if contract_a is None and contract_b is None:
        return {}, None
    if contract_a is None or contract_b is None:
        side, other = ("A", "B") if contract_a is None else ("B", "A")
        return {}, f"execution contract: only trace {other} has one (trace {side} records none): not compared"
    mismatch = {}
    for key in sorted(set(contract_a) | set(contract_b)):
        va, vb = contract_a.get(key, ABSENT), contract_b.get(key, ABSENT)
        if va is ABSENT or vb is ABSENT or not _same_json(va, vb):
            mismatch[key] = (va, vb)
    return mismatch, None


def _same_json(x, y) -> bool:
    """Equal JSON texts (keys sorted): tells 1 from 1.0 from true and -0.0 from 0.0 (the bits of a config may
    depend on which it was), and a NaN equals a NaN (the same value written twice is the same contract)."""
    return _json_text(x) == _json_text(y)


def _json_text(value) -> str:
    return json.dumps(value, sort_keys=True, allow_nan=True)


def json_safe(value):
    """`value` with every non-finite float written as the string "NaN", "Infinity" or "-Infinity" (JSON has
    no such numbers) and tuples as lists: what `json.dumps(..., allow_nan=False)` accepts."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def _contract_json(mismatch: dict[str, tuple]) -> dict:
    return {key: {side: value for side, value in (("a", va), ("b", vb)) if value is not ABSENT}
            for key, (va, vb) in mismatch.items()}


def _contract_lines(mismatch: dict[str, tuple], note: str | None) -> list[str]:
    if note:
        return [note]
    if not mismatch:
        return []
    lines = [f"execution contract differs ({len(mismatch)} key{'s' if len(mismatch) != 1 else ''}); "
             "the bits are not expected to agree:"]
    for key, (va, vb) in mismatch.items():
        lines.append(f"  {key}: A {_show(va)}   B {_show(vb)}")
    return lines


def _show(value) -> str:
    return "(absent)" if value is ABSENT else json.dumps(value, sort_keys=True)


@dataclass
class TraceDiff:
    """Result of `diff_traces`: `identical`, records compared, and the first divergence if any.

    contract_mismatch: execution-contract keys whose values differ, key -> (value in A, value in B)
    (`ABSENT` where a side lacks the key); a mismatch makes the traces not identical whatever their
    tensors. contract_note: a sentence when only one side records a contract (then nothing is compared).
    """

    a: str
    b: str
    compared: int
    divergence: Divergence | None
    contract_mismatch: dict[str, tuple] = field(default_factory=dict)
    contract_note: str | None = None
    sampling_note: str | None = None

    @property
    def identical(self) -> bool:
        """No divergence, the same contract, and at least one record compared: two traces that share no
        recorded step prove nothing."""
        return self.divergence is None and not self.contract_mismatch and self.compared > 0

    def to_json(self) -> dict:
        return {"a": self.a, "b": self.b, "identical": self.identical,
                "contract_mismatch": _contract_json(self.contract_mismatch), "contract_note": self.contract_note,
                "sampling_note": self.sampling_note, "compared": self.compared,
                "divergence": None if self.divergence is None else asdict(self.divergence)}

    def describe(self) -> str:
        lines = _contract_lines(self.contract_mismatch, self.contract_note)
        lines += [self.sampling_note] if self.sampling_note else []
        if self.divergence is None and not self.compared:
            lines.append("no record in a step both traces record: nothing was compared")
        elif self.divergence is None:
            lines.append(f"identical: {self.compared} records" if not self.contract_mismatch
                         else f"records identical: {self.compared} records (but the contracts differ)")
        else:
            lines.append(self.divergence.describe())
        return "\n".join(lines)


def diff_traces(a: Trace | str | os.PathLike, b: Trace | str | os.PathLike) -> TraceDiff:
    """First divergence between two traces in execution order (step, seq). Reads both as streams.
    Raises the errors of `Trace(path)` (ArgumentError, InputNotFoundError, TraceError, SchemaVersionError),
    and TraceError for a trace that fails SQLite's integrity check or whose steps miscount their records."""
    with opened(a) as trace_a, opened(b) as trace_b:
        _check_integrity(trace_a, trace_b)
        mismatch, note = contract_difference(trace_a, trace_b)
        result = _diff(trace_a, trace_b)
        result.contract_mismatch, result.contract_note = mismatch, note
        result.sampling_note = sampling.note(trace_a.sampling, trace_b.sampling)
        return result


def _check_integrity(*traces: Trace) -> None:
    """No verdict on a corrupt file: SQLite's integrity check and the steps' record counts, before comparing."""
    for trace in traces:
        trace.check_integrity()


def _diff(trace_a: Trace, trace_b: Trace) -> TraceDiff:
    compared = 0
    # A step that one side's rate skips is left out of the other: only a step both should hold is compared.
    records_a = sampling.filter_steps(trace_a.records(), trace_b.sampling)
    records_b = sampling.filter_steps(trace_b.records(), trace_a.sampling)
    # With other name sets the two sides number a step's records differently: their order is compared, not seq.
    same_names = trace_a.sampling.get("names") == trace_b.sampling.get("names")
    for position, (ra, rb) in enumerate(zip_longest(records_a, records_b)):
        divergence = _first_difference(position, ra, rb, same_names)
        if divergence is not None:
            return TraceDiff(str(trace_a.path), str(trace_b.path), compared, divergence)
        compared += 1
    return TraceDiff(str(trace_a.path), str(trace_b.path), compared, None)


def _first_difference(position: int, ra: Record | None, rb: Record | None, same_names: bool = True
                      ) -> Divergence | None:
    if ra is None or rb is None:
        return Divergence(position, "missing_in_a" if ra is None else "missing_in_b", _summary(ra), _summary(rb))
    if ((ra.step, ra.phase, ra.name, ra.kind) != (rb.step, rb.phase, rb.name, rb.kind)
            or (same_names and ra.seq != rb.seq)):
        return Divergence(position, "event", _summary(ra), _summary(rb))
    if ra.dtype != rb.dtype:
        return Divergence(position, "dtype", _summary(ra), _summary(rb))
    if ra.shape != rb.shape:
        return Divergence(position, "shape", _summary(ra), _summary(rb))
    if ra.digest == rb.digest:
        return None
    divergence = Divergence(position, "digest", _summary(ra), _summary(rb))
    rows_a, rows_b = ra.row_digests(), rb.row_digests()
    index_a, index_b = ra.row_indices(), rb.row_indices()
    if rows_a is not None and rows_b is not None and (index_a is not None or index_b is not None
                                                      or len(rows_a) == len(rows_b)):
        index, rows_a, rows_b = sampling.common_rows(index_a, rows_a, index_b, rows_b)
        differ = index[rows_a != rows_b]
        divergence.rows = differ[:_MAX_LISTED_ROWS].tolist()
        divergence.n_rows_differ = int(differ.size)
        divergence.n_rows = int(index.size)
        divergence.sampled = index_a is not None or index_b is not None
    return divergence


# -- content alignment -------------------------------------------------------------------------------

@dataclass
class OpAlignment:
    """Content alignment of one op name.

    matched: distinct input rows present in both traces; mismatched: of those, how many have different
    output rows; only_a / only_b: distinct input rows seen in one trace only; inconsistent_a / _b: input
    rows that produced different outputs at different places in the same trace (batch variance);
    skipped: input/output pairs that are not per-row (row counts differ) or lack row digests.
    keyed_by: 'input' (rows matched by input row, outputs compared) or 'output' (the op records no
    inputs, e.g. an embedding lookup: output rows are looked up on the other side, so differing rows
    show as only_a / only_b, never as mismatched).
    first_mismatch: where the first mismatching row sits in each trace (step, seq of the output, row).
    stopped_matching: rows matched at the input-keyed op before (`after`) that lose their partner here on both sides:
    a divergence between the two ops, in code neither trace records (rows followed by position; where they cannot
    be, counted when over half of the op before's matched rows).
    """

    name: str
    keyed_by: str = "input"
    matched: int = 0
    mismatched: int = 0
    only_a: int = 0
    only_b: int = 0
    inconsistent_a: int = 0
    inconsistent_b: int = 0
    skipped: int = 0
    first_mismatch: dict | None = None
    stopped_matching: int = 0
    after: str | None = None

    @property
    def ok(self) -> bool:
        return not (self.mismatched or self.inconsistent_a or self.inconsistent_b or self.stopped_matching)


@dataclass
class ContentDiff:
    """Result of `align_by_content`; `identical`: some rows matched by input, none mismatched or inconsistent."""

    a: str
    b: str
    ops: list[OpAlignment] = field(default_factory=list)
    contract_mismatch: dict[str, tuple] = field(default_factory=dict)
    contract_note: str | None = None
    sampling_note: str | None = None

    @property
    def matched(self) -> int:
        return sum(op.matched for op in self.ops)

    @property
    def identical(self) -> bool:
        """No mismatch and no inconsistency, at least one row compared (matched by its input), and no
        execution-contract mismatch."""
        compared = any(op.keyed_by == "input" and op.matched > 0 for op in self.ops)
        return compared and all(op.ok for op in self.ops) and not self.contract_mismatch

    @property
    def first_mismatch(self) -> OpAlignment | None:
        return next((op for op in self.ops if not op.ok), None)

    def to_json(self) -> dict:
        return {"a": self.a, "b": self.b, "identical": self.identical,
                "contract_mismatch": _contract_json(self.contract_mismatch), "contract_note": self.contract_note,
                "sampling_note": self.sampling_note, "matched": self.matched, "ops": [asdict(op) for op in self.ops]}

    def describe(self) -> str:
        lines = _contract_lines(self.contract_mismatch, self.contract_note)
        lines += [self.sampling_note] if self.sampling_note else []
        for op in self.ops:
            flags = "" if op.ok else "  <-- DIFFERS"
            by = " (by output rows)" if op.keyed_by == "output" else ""
            lines.append(f"{op.name}{by}: matched {op.matched}, mismatched {op.mismatched}, only in A {op.only_a}, "
                         f"only in B {op.only_b}, inconsistent A/B {op.inconsistent_a}/{op.inconsistent_b}"
                         + (f", skipped {op.skipped}" if op.skipped else "") + flags)
            if op.stopped_matching:
                lines.append(f"  {op.stopped_matching} input rows matched at {op.after} but not here: the traces "
                             f"diverged between {op.after} and {op.name}, in code they do not record")
        bad = self.first_mismatch
        if bad is not None and bad.first_mismatch is not None:
            fm = bad.first_mismatch
            lines.append(f"first mismatch: {bad.name}: A step {fm['a'][0]} seq {fm['a'][1]} row {fm['a'][2]} vs "
                         f"B step {fm['b'][0]} seq {fm['b'][1]} row {fm['b'][2]}")
        if not self.ops:
            lines.append("no per-row op (input and output records of one name, with row digests) in both traces")
        elif not any(op.keyed_by == "input" and op.matched for op in self.ops):
            lines.append("no row matched by input content: nothing was compared")
        lines.append("identical: all matched rows agree" if self.identical else "diverged")
        return "\n".join(lines)


def _row_map(trace: Trace, names: Sequence[str] | None, per_step: bool = False,
             steps: Sequence[int] | None = None, lineage: list | None = None, other: dict | None = None) -> dict:
    """key -> (keyed_by, table, inconsistent digests, skipped pairs); key = op name, or (step, name)
    with per_step (rows are then only matched inside one step).

    table maps key row digest -> (output row digest, step, seq, row). keyed_by is 'input' when the
    name's outputs follow inputs of the same name (key = input row), 'output' when the name only
    records outputs (key = the output row itself: rows can then be found on both sides, not compared).
    steps: read only these steps' records.
    lineage: when given, gets (step, name, input row digests) of every input-keyed record with all its rows, in
    trace order (the rows of one forward keep their positions from op to op: `_rows_that_stop_matching`).
    other: the other trace's rate setting; the names it does not record are left out.
    """
    tables: dict[tuple[Hashable, str], dict[int, tuple[int, int, int, int]]] = {}
    inconsistent: dict[Hashable, set[int]] = {}
    skipped: dict[Hashable, int] = {}
    last_input: dict[str, Record] = {}
    order: list[Hashable] = []
    other_records = None if other is None else sampling.name_selector(other)
    for record in records_of_steps(trace, steps):
        if names is not None and not any(fnmatch.fnmatchcase(record.name, p) for p in names):
            continue
        if other_records is not None and not other_records(record.name):
            continue
        if record.kind == "input":
            last_input[record.name] = record
            continue
        if record.kind != "output":
            continue
        key = (record.step, record.name) if per_step else record.name
        if key not in inconsistent:
            order.append(key)
            inconsistent[key] = set()
        inp = last_input.pop(record.name, None)
        rows_out = record.row_digests()
        if inp is not None and inp.step == record.step:
            mode, rows_in = "input", inp.row_digests()
        else:
            mode, rows_in = "output", rows_out
        index = record.row_indices()  # kept rows of a sampled trace: the input's, when paired with one
        if (rows_in is None or rows_out is None or len(rows_in) != len(rows_out)
                or (mode == "input" and not _same_index(inp.row_indices(), index))):
            skipped[key] = skipped.get(key, 0) + 1
            continue
        if lineage is not None and mode == "input" and index is None:
            lineage.append((record.step, record.name, rows_in))
        table = tables.setdefault((key, mode), {})
        bad = inconsistent[key]
        rows = range(len(rows_out)) if index is None else index.tolist()
        for row, din, dout in zip(rows, rows_in.tolist(), rows_out.tolist()):
            seen = table.get(din)
            if seen is None:
                table[din] = (dout, record.step, record.seq, row)
            elif seen[0] != dout:
                bad.add(din)
    result = {}
    for key in order:
        mode = "input" if (key, "input") in tables else "output"
        result[key] = (mode, tables.get((key, mode), {}), inconsistent[key], skipped.get(key, 0))
    return result


def _same_index(index_a, index_b) -> bool:
    if index_a is None or index_b is None:
        return index_a is None and index_b is None
    return np.array_equal(index_a, index_b)


@dataclass
class _RowMatch:
    """Rows of two `_row_map` tables matched by key: how many matched, how many of those differ, and
    the first differing pair of table entries (A's, B's), in A's table order."""

    matched: int = 0
    mismatched: int = 0
    only_a: int = 0
    only_b: int = 0
    first_mismatch: tuple[tuple, tuple] | None = None


def _match_rows(rows_a: dict, rows_b: dict) -> _RowMatch:
    match = _RowMatch()
    for din, entry_a in rows_a.items():
        entry_b = rows_b.get(din)
        if entry_b is None:
            match.only_a += 1
            continue
        match.matched += 1
        if entry_b[0] != entry_a[0]:
            match.mismatched += 1
            if match.first_mismatch is None:
                match.first_mismatch = (entry_a, entry_b)
    match.only_b = len(rows_b) - match.matched
    return match


def _keyed_by_output(table: dict) -> dict:
    return {value[0]: value for value in table.values()}


def align_by_content(a: Trace | str | os.PathLike, b: Trace | str | os.PathLike,
                     names: Sequence[str] | None = None) -> ContentDiff:
    """Compare per-row ops by content: rows matched by input-row digest, output-row digests compared.

    Ops that record only outputs (an embedding) are matched by output row (see OpAlignment.keyed_by).

    names: globs of op names to align (default: every name with output records).
    Ops are listed in trace A's order of first appearance, then those only in B.
    Raises the errors of `Trace(path)`, TraceError for a corrupt trace, ArgumentError for names that
    are not globs.
    """
    names = as_globs(names, "names")
    with opened(a) as trace_a, opened(b) as trace_b:
        _check_integrity(trace_a, trace_b)
        mismatch, note = contract_difference(trace_a, trace_b)
        lineage_a, lineage_b = [], []
        map_a = _row_map(trace_a, names, lineage=lineage_a, other=trace_b.sampling)
        map_b = _row_map(trace_b, names, lineage=lineage_b, other=trace_a.sampling)
        result = ContentDiff(str(trace_a.path), str(trace_b.path), contract_mismatch=mismatch, contract_note=note,
                             sampling_note=sampling.note(trace_a.sampling, trace_b.sampling))
    empty = ("output", {}, set(), 0)
    for name in list(map_a) + [n for n in map_b if n not in map_a]:
        mode_a, rows_a, inc_a, skip_a = map_a.get(name, empty)
        mode_b, rows_b, inc_b, skip_b = map_b.get(name, empty)
        if mode_a != mode_b:  # one side recorded no inputs: fall back to finding output rows
            rows_a = _keyed_by_output(rows_a) if mode_a == "input" else rows_a
            rows_b = _keyed_by_output(rows_b) if mode_b == "input" else rows_b
        keyed_by = "input" if mode_a == mode_b == "input" else "output"
        op = OpAlignment(name, keyed_by=keyed_by, inconsistent_a=len(inc_a), inconsistent_b=len(inc_b),
                         skipped=skip_a + skip_b)
        match = _match_rows(rows_a, rows_b)
        op.matched, op.mismatched, op.only_a, op.only_b = match.matched, match.mismatched, match.only_a, match.only_b
        if match.first_mismatch is not None:
            entry_a, entry_b = match.first_mismatch
            op.first_mismatch = {"a": list(entry_a[1:]), "b": list(entry_b[1:])}
        result.ops.append(op)
    tables_a = {name: rows for name, (mode, rows, _, _) in map_a.items() if mode == "input"}
    tables_b = {name: rows for name, (mode, rows, _, _) in map_b.items() if mode == "input"}
    _mark_rows_that_stop_matching(result.ops, _rows_that_stop_matching(result.ops, lineage_a, lineage_b,
                                                                       tables_a, tables_b))
    return result


def _lost_rows(lineage: list, previous_of: dict[str, str], own: dict, other: dict) -> dict[str, set[int]]:
    """name -> input digests, at the op before, of this side's rows that matched there (input and output) and whose
    input here has no partner on the other side. A row is followed by its position from the op before's latest
    record of the same step with as many rows (per-row ops keep a forward's rows in place). own / other: name ->
    the side's input-keyed table (`_row_map`)."""
    latest: dict[tuple[int, str], np.ndarray] = {}
    lost: dict[str, set[int]] = {}
    for step, name, rows_in in lineage:
        before = previous_of.get(name)
        earlier = latest.get((step, before)) if before is not None else None
        if earlier is not None and len(earlier) == len(rows_in):
            own_before, other_before, other_here = own.get(before, {}), other.get(before, {}), other.get(name, {})
            for din_before, din in zip(earlier.tolist(), rows_in.tolist()):
                theirs, ours = other_before.get(din_before), own_before.get(din_before)
                # a row whose output already differed before is that op's mismatch, not a loss in between
                if theirs is not None and ours is not None and theirs[0] == ours[0] and din not in other_here:
                    lost.setdefault(name, set()).add(din_before)
        latest[(step, name)] = rows_in
    return lost


def _rows_that_stop_matching(ops: list[OpAlignment], lineage_a: list, lineage_b: list, tables_a: dict,
                             tables_b: dict) -> dict[str, int]:
    """name -> rows that matched at the input-keyed op before and lose their partner here on both sides: the
    same input row before (one digest) is lost by A's row and by B's. Rows only one side runs here (padding, the
    trainer's last positions, an lm_head over last positions) lose their partner on one side only."""
    keyed = [op.name for op in ops if op.keyed_by == "input"]
    previous_of = dict(zip(keyed[1:], keyed[:-1]))
    lost_a = _lost_rows(lineage_a, previous_of, tables_a, tables_b)
    lost_b = _lost_rows(lineage_b, previous_of, tables_b, tables_a)
    return {name: len(lost_a[name] & lost_b[name]) for name in lost_a.keys() & lost_b.keys()
            if lost_a[name] & lost_b[name]}


def _mark_rows_that_stop_matching(ops: list[OpAlignment], followed: dict[str, int]) -> None:
    """Set stopped_matching (OpAlignment): rows followed from the op before (`_rows_that_stop_matching`); where
    rows cannot be followed (sampled traces, row counts that change between the ops), over half of the op before's
    matched rows lost on both sides."""
    previous = None
    for op in ops:
        if op.keyed_by != "input":
            continue
        if previous is not None and followed.get(op.name):
            op.stopped_matching, op.after = followed[op.name], previous.name
        elif previous is not None and previous.matched > 0:
            lost = min(op.only_a - previous.only_a, op.only_b - previous.only_b)
            if 2 * lost > previous.matched:
                op.stopped_matching, op.after = lost, previous.name
        previous = op
