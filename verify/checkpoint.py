"""Checkpoint comparison and manifests, streaming: one tensor (or one slab of rows) in memory at a time.

Sources (`open_source(path)`):
  - a safetensors file (read through safe_open: memory-mapped, slices read on demand)
  - sharded safetensors: `model.safetensors.index.json` (or the directory holding it)
  - torch `.pt` / `.bin` / `.pth` state dicts (torch.load with mmap=True, weights_only=True); nested
    dicts, lists and tuples are flattened with dots ({'l': [t]} -> 'l.0'; two tensors with one flattened
    name are refused); `pytorch_model.bin.index.json` shards likewise
  - a directory of any of those files
  - a verify manifest (JSON written by `hash_checkpoint`): names, dtypes, shapes and digests only
Tensors are compared bitwise (-0.0 != 0.0, NaN payloads count); for differing tensors the count of
differing elements and the largest absolute difference among them are reported (not available
against a manifest, where only digests compare).
"""
from __future__ import annotations

import math
import os
import sys
from contextlib import closing
from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

from verify.args import as_flag, as_path, same_file
from verify.checkpoint_sources import MANIFEST_FORMAT, MANIFEST_VERSION, Source, open_source
from verify.errors import CheckpointError, UnsupportedDtypeError
from verify.fingerprints import bits_view

# -- comparison -------------------------------------------------------------------------------------------

@dataclass
class TensorDiff:
    """A tensor present on both sides with equal dtype and shape but different bits.

    n_differ: differing elements (None against a manifest); max_abs_diff: largest |a - b| over differing
    elements that are not NaN on either side (inf if infinite; None if all involve NaN or no data);
    n_nan: differing elements where either side is NaN."""

    name: str
    dtype: str
    shape: list[int]
    n_elements: int
    n_differ: int | None = None
    max_abs_diff: float | None = None
    n_nan: int | None = None


@dataclass
class CheckpointDiff:
    """Result of `compare_checkpoints`. missing: in A only; extra: in B only; mismatched: dtype or
    shape differ (name, a_dtype, a_shape, b_dtype, b_shape)."""

    a: str
    b: str
    n_identical: int = 0
    differing: list[TensorDiff] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    mismatched: list[dict] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return not (self.differing or self.missing or self.extra or self.mismatched)

    def to_json(self) -> dict:
        doc = asdict(self)
        for d in doc["differing"]:
            if d["max_abs_diff"] is not None and not math.isfinite(d["max_abs_diff"]):
                d["max_abs_diff"] = str(d["max_abs_diff"])  # JSON has no inf
        return {"identical": self.identical, **doc}

    def describe(self) -> str:
        lines = []
        for d in self.differing:
            if d.n_differ is None:
                lines.append(f"differs: {d.name} {d.dtype} {d.shape} (digest differs from the manifest)")
            else:
                nan = f", {d.n_nan} involve NaN" if d.n_nan else ""
                lines.append(f"differs: {d.name} {d.dtype} {d.shape}: {d.n_differ} of {d.n_elements} elements, "
                             f"max abs diff {d.max_abs_diff}{nan}")
        for m in self.mismatched:
            lines.append(f"mismatch: {m['name']}: A {m['a_dtype']} {m['a_shape']} vs B {m['b_dtype']} {m['b_shape']}")
        lines += [f"missing in B: {name}" for name in self.missing]
        lines += [f"extra in B: {name}" for name in self.extra]
        total = self.n_identical + len(self.differing)
        if self.identical:
            lines.append(f"identical: {self.n_identical} tensors")
        else:
            lines.append(f"diverged: {len(self.differing)} of {total} common tensors differ, {len(self.mismatched)} "
                         f"dtype/shape mismatches, {len(self.missing)} missing in B, {len(self.extra)} extra in B")
        return "\n".join(lines)


def _progress(total: int, desc: str, enabled: bool | None):
    # enabled=None: show only on an interactive stderr and for more than a handful of tensors.
    disable = (not sys.stderr.isatty() or total < 8) if enabled is None else not enabled
    return tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr, disable=disable, leave=False)


def compare_checkpoints(a: str | os.PathLike, b: str | os.PathLike, progress: bool | None = None) -> CheckpointDiff:
    """Compare two checkpoints (or manifests) tensor by tensor, streaming. progress: True, False or None
    (a bar on an interactive stderr). Raises the errors of `open_source`, and ArgumentError."""
    progress = as_flag(progress, "progress", optional=True)
    with closing(open_source(a)) as src_a, closing(open_source(b)) as src_b:
        return _compare(src_a, src_b, progress)


def _compare(src_a: Source, src_b: Source, progress: bool | None) -> CheckpointDiff:
    result = CheckpointDiff(str(src_a.path), str(src_b.path))
    names_b = set(src_b.names())
    names_a = src_a.names()
    set_a = set(names_a)
    result.extra = [n for n in src_b.names() if n not in set_a]
    with _progress(len(names_a), "comparing", progress) as bar:
        for name in names_a:
            bar.update(1)
            if name not in names_b:
                result.missing.append(name)
                continue
            (dtype_a, shape_a), (dtype_b, shape_b) = src_a.info(name), src_b.info(name)
            if dtype_a != dtype_b or shape_a != shape_b:
                result.mismatched.append({"name": name, "a_dtype": dtype_a, "a_shape": list(shape_a),
                                          "b_dtype": dtype_b, "b_shape": list(shape_b)})
                continue
            if src_a.has_data and src_b.has_data:
                try:
                    diff = _compare_tensor(name, dtype_a, shape_a, src_a.slabs(name), src_b.slabs(name))
                except UnsupportedDtypeError as e:
                    raise UnsupportedDtypeError(f"{src_a.path}: tensor {name!r}: {e}") from None
            elif src_a.digest(name) == src_b.digest(name):
                diff = None
            else:
                diff = TensorDiff(name, dtype_a, list(shape_a), math.prod(shape_a))
            if diff is None:
                result.n_identical += 1
            else:
                result.differing.append(diff)
    return result


def _compare_tensor(name, dtype, shape, slabs_a, slabs_b) -> TensorDiff | None:
    n_differ = n_nan = 0
    max_abs: float | None = None
    for slab_a, slab_b in zip(slabs_a, slabs_b):
        differ = bits_view(slab_a).reshape(-1) != bits_view(slab_b).reshape(-1)
        count = int(differ.sum())
        if count == 0:
            continue
        n_differ += count
        if slab_a.dtype == torch.bool:
            continue
        va = slab_a.reshape(-1)[differ].double()
        vb = slab_b.reshape(-1)[differ].double()
        nan = va.isnan() | vb.isnan()
        n_nan += int(nan.sum())
        if bool((~nan).any()):
            slab_max = float((va[~nan] - vb[~nan]).abs().max())
            max_abs = slab_max if max_abs is None else max(max_abs, slab_max)
    if n_differ == 0:
        return None
    return TensorDiff(name, dtype, list(shape), math.prod(shape), n_differ, max_abs, n_nan)


def check_not_an_input(source_path: str | os.PathLike, output: str | os.PathLike) -> None:
    """CheckpointError when `output` is (any spelling, symlink or hard link of) a file the checkpoint or
    manifest at `source_path` is read from: a manifest written there would destroy its own input."""
    output = as_path(output, "output")
    if not output.exists():
        return
    with closing(open_source(source_path)) as source:
        inputs = source.files()
    for file in inputs:
        if same_file(output, file):
            raise CheckpointError(f"refusing to write the manifest over {output}: it is an input of the checkpoint "
                                  f"{source_path} ({file.name})")


# -- manifests --------------------------------------------------------------------------------------------

def hash_checkpoint(path: str | os.PathLike, progress: bool | None = None) -> dict:
    """A manifest of a checkpoint: {"format", "version", "source", "tensors": {name: {dtype, shape, digest}}}.
    Raises the errors of `open_source`, and ArgumentError."""
    progress = as_flag(progress, "progress", optional=True)
    tensors = {}
    with closing(open_source(path)) as source, _progress(len(source.names()), "hashing", progress) as bar:
        for name in source.names():
            dtype, shape = source.info(name)
            tensors[name] = {"dtype": dtype, "shape": list(shape), "digest": source.digest(name)}
            bar.update(1)
    return {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "source": str(path), "tensors": tensors}
