"""A recorded step's records, built from host arrays: in the recording process (verify/recorder.py) or in its
writer process (verify/writer_process.py), by the same code."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from verify.capture import RingWords, parse_ring
from verify.fingerprints import combine_bytes, dtype_name
from verify.sampling import keep_rows
from verify.store import Record
from verify.trace_writer import TraceWriter

DEFAULT_PHASE = {"input": "forward", "output": "forward", "grad": "backward", "param": "after_backward"}


class PendingRecord(NamedTuple):
    """A record of a step before its row digests reach the host."""

    seq: int
    phase: str
    name: str
    kind: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    keep_rows: bool


@dataclass
class StepData:
    """One recorded step as host arrays: what `commit_step` turns into the trace's records, in the recording
    process or in its writer process (verify/writer_process.py)."""

    step: int
    records: list[PendingRecord]  # recorded from Python, in order
    digests: list[np.ndarray]  # int64 [R] row digests, one per record
    rings: list[RingWords]  # each capture tap's entries, after the records
    site_keys: list[tuple[str, str, torch.dtype]]  # verify/capture.py site_keys() when the rings were taken
    rows: bool  # the tap entries' keep_rows
    row_every: int
    complete: bool


def commit_step(writer: TraceWriter, data: StepData) -> None:
    """Build a step's records (whole-tensor digests, the row digests kept) and commit them with `writer`."""
    harvested, lost = _merged(parse_ring(ring, data.site_keys) for ring in data.rings)
    records = data.records + [PendingRecord(len(data.records) + i, DEFAULT_PHASE[e.kind], e.name, e.kind, e.dtype,
                                            e.shape, data.rows) for i, e in enumerate(harvested)]
    digests = data.digests + [e.digests_R.numpy() for e in harvested]
    rows = []
    for p, digests_R, index in zip(records, digests, _kept_rows(records, digests, data.row_every)):
        all_rows = digests_R.astype("<i8", copy=False).tobytes()
        rows.append(Record(data.step, p.seq, p.phase, p.name, p.kind, dtype_name(p.dtype), p.shape,
                           combine_bytes(p.dtype, p.shape, all_rows),
                           None if not p.keep_rows else all_rows if index is None
                           else digests_R[index].astype("<i8", copy=False).tobytes(),
                           None if index is None or not p.keep_rows else index.astype("<u8").tobytes()))
    writer.write_step(data.step, rows, complete=data.complete, lost=lost)


def _kept_rows(records: list[PendingRecord], digests: list[np.ndarray], row_every: int) -> list:
    """Per record, the indices of the rows whose digests are kept (None: all). An output keeps the rows
    its input (the last input record of its name, same row count) kept, as content alignment pairs
    them (verify.compare._row_map); any other record chooses by its own row digests."""
    if row_every == 1:
        return [None] * len(records)
    kept, last_input = [], {}
    for p, digests_R in zip(records, digests):
        paired = last_input.pop(p.name, None) if p.kind == "output" else None
        if paired is not None and paired[0] == len(digests_R):
            index = paired[1]
        else:
            index = keep_rows(digests_R, row_every)
        if p.kind == "input":
            last_input[p.name] = (len(digests_R), index)
        kept.append(index)
    return kept


def _merged(harvests: Iterable[tuple[list, bool]]) -> tuple[list, bool]:
    """The taps' (entries, lost) as one: entries in tap order, lost if any tap lost some."""
    entries, lost = [], False
    for tap_entries, tap_lost in harvests:
        entries += tap_entries
        lost |= tap_lost
    return entries, lost
