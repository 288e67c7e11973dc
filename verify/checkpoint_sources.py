"""Checkpoint sources for verify/checkpoint.py: `open_source(path)` gives a `Source` (names, dtypes, shapes and
slabs of rows) for each layout that module lists; a file or directory it cannot read is a CheckpointError naming it."""
from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

from verify.args import as_path, special_file
from verify.errors import CheckpointError, InputNotFoundError, ManifestError, UnsupportedDtypeError, VerifyError
from verify.fingerprints import _DTYPE_CODES, RowSum, bits_view, combine, dtype_name, row_digests_async

MANIFEST_FORMAT = "mok-verify-manifest"
MANIFEST_VERSION = 1
# Tensors are read in slabs of leading-dim rows of about this many bytes.
SLAB_BYTES = 256 << 20
_SAFETENSORS_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
    "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16", "F32": "float32",
    "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
    "C64": "complex64",
}
_TORCH_SUFFIXES = (".pt", ".bin", ".pth")
_MANIFEST_DTYPES = frozenset(dtype_name(d) for d in _DTYPE_CODES)
_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


# -- sources -------------------------------------------------------------------------------------------

class Source:
    """A named collection of tensors. `names()` in file order; `info(name)` -> (dtype name, shape)
    without reading data; `slabs(name)` yields the tensor as consecutive leading-dim slabs; `digest(name)`
    -> verify.fingerprint of the tensor."""

    path: Path
    has_data = True

    def names(self) -> list[str]:
        raise NotImplementedError

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        raise NotImplementedError

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """The tensor, or rows [start, stop) of its first dim."""
        raise NotImplementedError

    def slabs(self, name: str) -> Iterator[torch.Tensor]:
        """Consecutive slabs of about SLAB_BYTES: runs of leading-dim rows, or for a 1-D tensor runs of
        elements (a multiple of 8 elements each but the last: whole 64-bit words, see `digest`)."""
        dtype, shape = self.info(name)
        if len(shape) == 0:
            yield self.read(name)
            return
        if len(shape) == 1:
            step = max(8, SLAB_BYTES // _itemsize(dtype) // 8 * 8)
        else:
            row_bytes = max(1, math.prod(shape[1:]) * _itemsize(dtype))
            step = max(1, SLAB_BYTES // row_bytes)
        if shape[0] <= step:
            yield self.read(name)
            return
        for start in range(0, shape[0], step):
            yield self.read(name, start, min(shape[0], start + step))

    def digest(self, name: str) -> str:
        dtype, shape = self.info(name)
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise UnsupportedDtypeError(f"{self.path}: tensor {name} has dtype {dtype}, not one fingerprints cover")
        if len(shape) == 1:  # one row: its word sum is accumulated slab by slab (same bits as in one piece)
            row = RowSum(torch_dtype, shape[0])
            for slab in self.slabs(name):
                row.update(bits_view(slab))
                del slab  # not held while the next slab is read: one slab in memory at a time
            value = row.digest()
            rows_R = torch.tensor([value - (1 << 64) if value >> 63 else value], dtype=torch.int64)
        else:
            digests = []
            for slab in self.slabs(name):
                digests.append(row_digests_async(slab).cpu())
                del slab
            rows_R = torch.cat(digests) if digests else torch.empty(0, dtype=torch.int64)
        return combine(torch_dtype, shape, rows_R)

    def files(self) -> list[Path]:
        """The files this source reads (an index and its shards, a directory's checkpoint files, ...)."""
        return [self.path]

    def close(self) -> None:
        pass


def _itemsize(dtype: str) -> int:
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise UnsupportedDtypeError(f"unknown dtype {dtype}")
    return torch_dtype.itemsize


class SafetensorsFile(Source):
    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = path
        try:
            self._file = safe_open(str(path), framework="pt")
            self._names = list(self._file.keys())
        except Exception as e:  # safetensors raises its own SafetensorError (and OSError)
            raise CheckpointError(f"{path}: not a readable safetensors file ({_one_line(e)})") from None

    def names(self) -> list[str]:
        return self._names

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        sl = self._file.get_slice(name)
        dtype = sl.get_dtype()
        return _SAFETENSORS_DTYPES.get(dtype, dtype.lower()), tuple(sl.get_shape())

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        try:
            if start is None:
                return self._file.get_tensor(name)
            return self._file.get_slice(name)[start:stop]
        except Exception as e:
            raise CheckpointError(f"{self.path}: cannot read tensor {name} ({_one_line(e)})") from None


class TorchFile(Source):
    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            is_zip = f.read(2) == b"PK"
        try:
            # Zip-format files (torch.save's default) are memory-mapped; legacy pickles cannot be.
            state = torch.load(path, map_location="cpu", mmap=is_zip, weights_only=True)
        except Exception as e:  # torch raises RuntimeError, UnpicklingError, EOFError, ... on bad files
            why = _one_line(e) if is_zip else "neither a zip-format torch.save file nor a loadable legacy pickle"
            raise CheckpointError(f"{path}: not a readable torch checkpoint ({why})") from None
        if not isinstance(state, dict):
            raise CheckpointError(f"{path}: a torch file holding {type(state).__name__}, not a state dict")
        self._tensors: dict[str, torch.Tensor] = {}
        _flatten(state, "", self._tensors, path)

    def names(self) -> list[str]:
        return list(self._tensors)

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        t = self._tensors[name]
        return dtype_name(t.dtype), tuple(t.shape)

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        t = self._tensors[name]
        return t if start is None else t[start:stop]


def _flatten(value, prefix: str, out: dict[str, torch.Tensor], path: Path) -> None:
    """Every tensor of nested dicts, lists and tuples, named by its keys and indices joined with dots
    ({'l': [t]} -> 'l.0'). Two tensors that would get one name are a CheckpointError (never one dropped).
    Leaves that are not tensors (numbers, strings) are not compared."""
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in items:
        name = f"{prefix}{key}"
        if isinstance(item, torch.Tensor):
            if item.layout != torch.strided or item.is_quantized:  # its bytes are not its values
                kind = "quantized" if item.is_quantized else str(item.layout).removeprefix("torch.")
                raise UnsupportedDtypeError(f"{path}: tensor {name!r} is a {kind} tensor; checkpoints are compared "
                                            "as dense tensors (save it with .to_dense() / .dequantize())")
            if name in out:
                raise CheckpointError(f"{path}: two tensors flatten to the name {name!r} (e.g. a key {name!r} "
                                      "and nested keys that join to it); cannot compare them by name")
            out[name] = item
        elif isinstance(item, (dict, list, tuple)):
            _flatten(item, f"{name}.", out, path)


class MultiFile(Source):
    """Several files seen as one checkpoint (shards, or every checkpoint file of a directory)."""

    def __init__(self, path: Path, files: list[Path], weight_map: dict[str, str] | None = None):
        self.path = path
        self._files = {f: None for f in files}
        self._owner: dict[str, Path] = {}
        if weight_map is not None:
            folder = path.parent if path.is_file() else path
            for name, file in weight_map.items():
                if not isinstance(file, str) or not file or Path(file).is_absolute() or ".." in Path(file).parts:
                    raise CheckpointError(f"{path}: the weight map puts {name!r} in {json.dumps(file)}, not a file "
                                          "name inside the index's folder")
                self._owner[name] = folder / file
            missing = sorted({str(f) for f in self._owner.values() if not f.is_file()})
            if missing:
                raise CheckpointError(f"{path}: shard listed in the index is missing: {missing[0]}")
            special = sorted(f"{f} is {special_file(f)}" for f in set(self._owner.values()) if special_file(f))
            if special:
                raise CheckpointError(f"{path}: shard listed in the index is not a regular file: {special[0]}")
            self._files = {f: None for f in self._owner.values()}
        else:
            for file in files:
                for name in self._open(file).names():
                    if name in self._owner:
                        raise CheckpointError(f"{path}: tensor {name} is in both {self._owner[name].name} "
                                              f"and {file.name}")
                    self._owner[name] = file

    def _open(self, file: Path) -> Source:
        source = self._files.get(file)
        if source is None:
            source = self._files[file] = _open_file(file)
        return source

    def names(self) -> list[str]:
        return list(self._owner)

    def files(self) -> list[Path]:
        return ([self.path] if self.path.is_file() else []) + list(self._files)

    def _source(self, name: str) -> Source:
        source = self._open(self._owner[name])
        if name not in source.names():
            raise CheckpointError(f"{self.path}: the index puts {name} in {self._owner[name].name}, which lacks it")
        return source

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        return self._source(name).info(name)

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        return self._source(name).read(name, start, stop)

    def close(self) -> None:
        for source in self._files.values():
            if source is not None:
                source.close()


class Manifest(Source):
    """A manifest: digests without data."""

    has_data = False

    def __init__(self, path: Path, doc: dict):
        self.path = path
        if doc.get("format") != MANIFEST_FORMAT or not isinstance(doc.get("tensors"), dict):
            raise ManifestError(f"{path}: JSON but not a verify manifest (no \"format\": \"{MANIFEST_FORMAT}\")")
        if doc.get("version") != MANIFEST_VERSION:
            raise ManifestError(f"{path}: manifest version {doc.get('version')}; this verify reads {MANIFEST_VERSION}")
        self._tensors = doc["tensors"]
        for name, entry in self._tensors.items():
            if not (isinstance(entry, dict) and {"dtype", "shape", "digest"} <= entry.keys()):
                raise ManifestError(f"{path}: manifest entry {name!r} lacks dtype, shape or digest")
            _check_manifest_entry(path, name, entry)

    def names(self) -> list[str]:
        return list(self._tensors)

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        entry = self._tensors[name]
        return entry["dtype"], tuple(entry["shape"])

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        raise CheckpointError(f"{self.path} is a manifest: it holds digests, not tensor data")

    def digest(self, name: str) -> str:
        return self._tensors[name]["digest"]


_HEX = frozenset("0123456789abcdef")


def _check_manifest_entry(path: Path, name: str, entry: dict) -> None:
    """A manifest entry must be what `hash_checkpoint` writes: a fingerprinted dtype, a list of sizes and
    a 32-hex-digit digest. Anything else is a ManifestError, never compared (or reported as a mismatch)."""
    dtype, shape, digest = entry["dtype"], entry["shape"], entry["digest"]
    if not (isinstance(dtype, str) and dtype in _MANIFEST_DTYPES):
        raise ManifestError(f"{path}: manifest entry {name!r} has dtype {dtype!r}, not one verify fingerprints")
    if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                            for d in shape)):
        raise ManifestError(f"{path}: manifest entry {name!r} has shape {json.dumps(shape)}, not a list of sizes")
    if not (isinstance(digest, str) and len(digest) == 32 and set(digest) <= _HEX):
        raise ManifestError(f"{path}: manifest entry {name!r} has digest {digest!r}, not 32 hex digits")


def _one_line(e: BaseException) -> str:
    """The exception's first line, cut after its first sentence when long."""
    text = (str(e).strip().splitlines() or [""])[0]
    if len(text) > 160 and ". " in text:
        text = text[:text.index(". ") + 1]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _read_json(path: Path, what: str) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        cls = ManifestError if what == "manifest" else CheckpointError
        raise cls(f"{path}: {what} is not valid JSON ({_one_line(e)})") from None
    if not isinstance(doc, dict):
        raise (ManifestError if what == "manifest" else CheckpointError)(f"{path}: {what} is not a JSON object")
    return doc


def _open_json(path: Path) -> Source:
    is_index = path.name.endswith(".index.json")
    doc = _read_json(path, "index" if is_index else "manifest")
    if "weight_map" in doc:
        if not isinstance(doc["weight_map"], dict):
            raise CheckpointError(f"{path}: weight_map is not an object")
        return MultiFile(path, [], weight_map=doc["weight_map"])
    return Manifest(path, doc)


def _open_file(path: Path) -> Source:
    try:
        return _open_file_unchecked(path)
    except VerifyError:
        raise
    except OSError as e:  # unreadable (permissions, I/O error): one typed line, not a traceback
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None


def _open_file_unchecked(path: Path) -> Source:
    suffix = path.suffix.lower()
    if suffix == ".json":
        return _open_json(path)
    if suffix == ".safetensors":
        return SafetensorsFile(path)
    if suffix in _TORCH_SUFFIXES:
        return TorchFile(path)
    with open(path, "rb") as f:
        head = f.read(9)
    if head[:2] == b"PK":
        return TorchFile(path)
    if len(head) == 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] < (100 << 20):
        return SafetensorsFile(path)
    if head.lstrip()[:1] in (b"{", b"["):
        return _open_json(path)
    raise CheckpointError(f"{path}: unknown checkpoint format (expected safetensors, torch .pt/.bin, or JSON)")


def open_source(path: str | os.PathLike) -> Source:
    """Open a checkpoint file, shard index, directory or manifest for streaming reads.

    Raises ArgumentError (not a path), InputNotFoundError, CheckpointError (a special file, an unknown or
    corrupt format), ManifestError."""
    path = as_path(path, "checkpoint")
    if not path.exists():
        raise InputNotFoundError(f"checkpoint not found: {path}")
    kind = special_file(path)
    if kind is not None:  # never opened: reading a FIFO or a device could block or never end
        raise CheckpointError(f"{path} is {kind}, not a checkpoint file or directory")
    if path.is_file():
        return _open_file(path)
    for index in _INDEX_FILES:
        if (path / index).is_file():
            return _open_json(path / index)
    if not path.is_dir():
        raise CheckpointError(f"{path} is neither a regular file nor a directory")
    try:
        entries = sorted(p for p in path.iterdir() if p.is_file() and special_file(p) is None)
    except OSError as e:
        raise CheckpointError(f"cannot list {path}: {e.strerror or e}") from None
    files = [p for p in entries if p.suffix == ".safetensors"]
    if not files:
        files = [p for p in entries if p.suffix in _TORCH_SUFFIXES]
    if not files:
        raise CheckpointError(f"{path}: directory holds no .safetensors, .pt, .bin or .pth file")
    return MultiFile(path, files)
