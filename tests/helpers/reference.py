"""A slow, independent restatement of verify's fingerprint definition in Python integers.

Used to check the vectorised CPU path and, through it, the Triton path. It reads the tensor through
`.tolist()`-level bytes, not through verify's code, so a bug in verify's packing or mixing shows.
"""
from __future__ import annotations

import struct

import torch
import xxhash

M64 = (1 << 64) - 1
CODES = ["bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
         "float16", "bfloat16", "float32", "float64",
         "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"]


def mix(z: int) -> int:
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & M64
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def element_bytes(tensor: torch.Tensor) -> list[bytes]:
    """Raw little-endian bytes of each element in logical row-major order."""
    size = tensor.element_size()
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    as_u8 = flat.view(torch.uint8).reshape(-1, size) if flat.numel() else torch.empty(0, size, dtype=torch.uint8)
    return [bytes(row) for row in as_u8.tolist()]


def row_digests(tensor: torch.Tensor) -> list[int]:
    shape = tuple(tensor.shape)
    n = shape[-1] if shape else 1
    rows = 1
    for s in shape[:-1]:
        rows *= s
    elems = element_bytes(tensor)
    code = CODES.index(str(tensor.dtype).removeprefix("torch.")) + 1
    key = mix((code << 48) | n)
    out = []
    for r in range(rows):
        data = b"".join(elems[r * n:(r + 1) * n])
        data += b"\0" * (-len(data) % 8)
        total = 0
        for j in range(len(data) // 8):
            word = int.from_bytes(data[8 * j:8 * j + 8], "little")
            total = (total + mix(word ^ (((j + 1) * 0x9E3779B97F4A7C15) & M64))) & M64
        out.append(mix(total ^ key))
    return out


def fingerprint(tensor: torch.Tensor) -> str:
    shape = tuple(tensor.shape)
    header = b"mok-verify/fingerprint/1\0" + str(tensor.dtype).removeprefix("torch.").encode() + b"\0"
    header += struct.pack(f"<q{len(shape)}q", len(shape), *shape)
    return xxhash.xxh3_128(header + b"".join(struct.pack("<Q", d) for d in row_digests(tensor))).hexdigest()
