"""Bitwise-exact tensor fingerprints: one 64-bit digest per row, and one xxh3 digest per tensor.

Legend: R = rows (leading dims flattened; a 0-d tensor is one row of one element),
N = elements per row (the last dim), W = 64-bit words per row = ceil(N * itemsize / 8).

Definition (the CPU path here and the Triton path in `fingerprints_triton.py` compute it bit for bit):
  word_j    = the row's raw bytes (little endian, logical row-major order) packed into 64-bit words,
              the last word padded with zero bytes; j = 0 .. W-1
  key_j     = (j + 1) * GOLDEN                      (mod 2^64)
  row_sum   = sum_j mix64(word_j ^ key_j)           (mod 2^64)
  row digest = mix64(row_sum ^ tag_key),  tag_key = mix64(dtype_code << 48 | N)
  fingerprint = xxh3_128(header(dtype, shape) || row digests as little-endian uint64), hex.
mix64 is the splitmix64 finalizer, a bijection of 64-bit words. For a fixed j, word_j -> term is a
bijection, so a change confined to one word (any single-bit flip) changes the row digest with
certainty. Wrapping addition is associative and commutative, so any parallel reduction order on the
device gives the same bits as the sequential CPU loop. Packing several narrow elements into one word
keeps the number of 64-bit multiplies per byte low on the GPU (bf16: one mix per four elements).
Strides and storage offset never matter: the digest reads logical contents, so a non-contiguous
view and its contiguous copy agree; -0.0 and 0.0, and NaNs with different payloads, differ.
"""
from __future__ import annotations

import functools
import struct

import numpy as np
import torch
import xxhash

from verify.errors import ArgumentError, UnsupportedDtypeError

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MIX_C1 = 0xBF58476D1CE4E5B9
MIX_C2 = 0x94D049BB133111EB
_HEADER_MAGIC = b"mok-verify/fingerprint/1\0"

# Stable codes that enter every row digest: never renumber, only append.
_DTYPE_CODES: dict[torch.dtype, int] = {}
for _code, _name in enumerate(
    ["bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
     "float16", "bfloat16", "float32", "float64",
     "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"],
    start=1,
):
    if hasattr(torch, _name):
        _DTYPE_CODES[getattr(torch, _name)] = _code
_BITS_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Rows are mixed in blocks of about this many words on the CPU to bound temporary memory; a longer row
# (a large 1-D tensor is one row) is mixed in slices of this many words. Never changes a digest.
_CPU_BLOCK_WORDS = 1 << 22


def mix64(z: int) -> int:
    """splitmix64 finalizer on a Python int (mod 2^64)."""
    z &= MASK64
    z ^= z >> 30
    z = (z * MIX_C1) & MASK64
    z ^= z >> 27
    z = (z * MIX_C2) & MASK64
    return z ^ (z >> 31)


def dtype_name(dtype: torch.dtype) -> str:
    """'torch.bfloat16' -> 'bfloat16'."""
    return str(dtype).removeprefix("torch.")


def row_layout(shape: tuple[int, ...] | torch.Size) -> tuple[int, int]:
    """(R, N) of a tensor shape: leading dims flattened into rows; 0-d is one row of one element."""
    if len(shape) == 0:
        return 1, 1
    rows = 1
    for size in shape[:-1]:
        rows *= int(size)
    return rows, int(shape[-1])


def tag_key(dtype: torch.dtype, row_len: int) -> int:
    """The per-(dtype, N) key folded into each row digest, as an unsigned 64-bit Python int."""
    return mix64((_dtype_code(dtype) << 48) | (row_len & ((1 << 48) - 1)))


def _dtype_code(dtype: torch.dtype) -> int:
    code = _DTYPE_CODES.get(dtype)
    if code is None:
        raise UnsupportedDtypeError(f"fingerprints do not support dtype {dtype}")
    return code


def bits_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor reinterpreted as [R, N] raw bits (uint8/int16/int32/int64 of the same width).

    A view when the leading dims flatten without a copy, otherwise a contiguous copy; either way the
    logical row-major contents are preserved.
    """
    _dtype_code(tensor.dtype)
    rows, row_len = row_layout(tensor.shape)
    x_RN = tensor.reshape(rows, row_len)
    if tensor.dtype == torch.bool:
        return x_RN.view(torch.uint8)
    return x_RN.view(_BITS_VIEW[tensor.element_size()])


def _mix64_np(z: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer in place on a uint64 array (numpy wraps uint64 arithmetic mod 2^64)."""
    z ^= z >> np.uint64(30)
    z *= np.uint64(MIX_C1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(MIX_C2)
    z ^= z >> np.uint64(31)
    return z


def _word_sums(raw_RB: np.ndarray, word0: int) -> np.ndarray:
    """sum_j mix64(word_j ^ key_j) over the bytes of each row of raw_RB (uint8 [R, B]), whose first word
    is word `word0` of its row; the last word is zero-padded. -> uint64 [R] (mod 2^64)."""
    rows, n_bytes = raw_RB.shape
    n_words = (n_bytes + 7) // 8
    if n_bytes % 8:
        padded = np.zeros((rows, n_words * 8), dtype=np.uint8)
        padded[:, :n_bytes] = raw_RB
        raw_RB = padded
    keys_W = np.arange(word0 + 1, word0 + n_words + 1, dtype=np.uint64) * np.uint64(GOLDEN)
    words_RW = np.ascontiguousarray(raw_RB).view("<u8") ^ keys_W
    return _mix64_np(words_RW).sum(axis=1, dtype=np.uint64)


class RowSum:
    """The word sum of one row fed in consecutive slices (for rows too long to hold twice in memory).

    Every slice but the last must be a whole number of 64-bit words (its element count a multiple of
    8 / itemsize; any multiple of 8 elements is). `digest()` gives the same bits as the row digest of
    the whole row: the sum is mod 2^64, so slicing does not change it.
    """

    def __init__(self, dtype: torch.dtype, row_len: int):
        self.key = tag_key(dtype, row_len)
        self.words = 0
        self.total = np.zeros(1, dtype=np.uint64)
        self._ended = False

    def update(self, bits: torch.Tensor) -> None:
        """bits: the next elements of the row, raw bits (any shape, read in row-major order), on the CPU."""
        if self._ended:
            raise ValueError("RowSum.update after a slice that was not a whole number of words")
        raw = bits.detach().reshape(-1).contiguous().view(torch.uint8).numpy().reshape(1, -1)
        if raw.shape[1] == 0:
            return
        if raw.shape[1] % 8:
            self._ended = True
        step = _CPU_BLOCK_WORDS * 8
        for b0 in range(0, raw.shape[1], step):  # bounded temporaries, as in _row_digests_cpu
            part = raw[:, b0:b0 + step]
            self.total += _word_sums(part, self.words)  # numpy arrays wrap mod 2^64 silently
            self.words += (part.shape[1] + 7) // 8

    def digest(self) -> int:
        """The row digest as an unsigned 64-bit int."""
        return mix64(int(self.total[0]) ^ self.key)


def _row_digests_cpu(bits_RN: torch.Tensor, key: int) -> torch.Tensor:
    """Row digests of raw bits [R, N] on the CPU -> int64 [R] (the uint64 bit pattern).

    Temporary memory stays about 2 x 8 x _CPU_BLOCK_WORDS bytes whatever the shape: short rows are
    mixed many at a time, a row longer than the block in slices of whole words (a 1-D tensor is one
    such row), the partial sums added mod 2^64, which gives the same bits as one pass.
    """
    rows, row_len = bits_RN.shape
    itemsize = bits_RN.element_size()
    row_bytes = row_len * itemsize
    n_words = (row_bytes + 7) // 8
    sums_R = np.zeros(rows, dtype=np.uint64)
    if n_words > 0 and rows > 0:
        if n_words <= _CPU_BLOCK_WORDS:
            rows_per_block = max(1, _CPU_BLOCK_WORDS // n_words)
            for r0 in range(0, rows, rows_per_block):
                block = bits_RN[r0:r0 + rows_per_block].contiguous()
                raw_RB = block.view(torch.uint8).numpy().reshape(block.shape[0], row_bytes)
                sums_R[r0:r0 + block.shape[0]] = _word_sums(raw_RB, 0)
        else:
            per_slice = _CPU_BLOCK_WORDS * (8 // itemsize)  # elements: a whole number of words
            for r in range(rows):
                for e0 in range(0, row_len, per_slice):
                    chunk = bits_RN[r, e0:e0 + per_slice].contiguous()
                    raw = chunk.view(torch.uint8).numpy().reshape(1, -1)
                    sums_R[r:r + 1] += _word_sums(raw, e0 // (8 // itemsize))
    sums_R ^= np.uint64(key)
    return torch.from_numpy(_mix64_np(sums_R).view(np.int64))


def row_bits(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(raw bits [R, N] as bits_view gives them, the row digests' tag key) of a tensor that can be fingerprinted;
    raises the typed errors of row_fingerprints for one that cannot."""
    if not isinstance(tensor, torch.Tensor):
        raise ArgumentError(f"a fingerprint needs a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_nested or tensor.layout != torch.strided:
        layout = "nested" if tensor.is_nested else str(tensor.layout).removeprefix("torch.")
        raise UnsupportedDtypeError(f"fingerprints cover dense (strided) tensors, not a {layout} tensor "
                                    "(convert it with .to_dense() first)")
    if tensor.device.type == "meta":
        raise UnsupportedDtypeError("cannot fingerprint a meta tensor (it has no contents)")
    bits_RN = bits_view(tensor.detach())
    return bits_RN, tag_key(tensor.dtype, bits_RN.shape[1])


def row_digests_async(tensor: torch.Tensor) -> torch.Tensor:
    """Row digests as int64 [R] holding the uint64 bit pattern, on the tensor's device.

    On CUDA this launches the Triton kernel and does not synchronise: the digests reflect the
    tensor's contents at call time (stream order), and only they ever move to the host.
    """
    bits_RN, key = row_bits(tensor)
    if bits_RN.is_cuda:
        if bits_RN.shape[0] == 0 or bits_RN.shape[1] == 0:
            value = mix64(key)  # an empty row's sum is 0
            return torch.full((bits_RN.shape[0],), value - (1 << 64) if value >> 63 else value, dtype=torch.int64,
                              device=bits_RN.device)
        from verify.fingerprints_triton import row_digests_triton

        return row_digests_triton(bits_RN, key)
    return _row_digests_cpu(bits_RN.cpu(), key)


def combine(dtype: torch.dtype, shape: tuple[int, ...] | torch.Size, row_digests_R: torch.Tensor) -> str:
    """The whole-tensor fingerprint from its row digests (int64 or uint64 [R], on the host)."""
    return combine_bytes(dtype, tuple(shape), digest_bytes(row_digests_R))


def digest_bytes(row_digests_R: torch.Tensor) -> bytes:
    """Row digests (int64 or uint64 [R], on the host) as the little-endian bytes that traces store and `combine`
    hashes."""
    return row_digests_R.contiguous().view(torch.int64).numpy().astype("<i8", copy=False).tobytes()


def combine_bytes(dtype: torch.dtype, shape: tuple[int, ...], row_digest_bytes: bytes) -> str:
    """`combine` of row digests already turned into bytes (`digest_bytes`)."""
    hasher = xxhash.xxh3_128(_combine_header(dtype, shape))
    hasher.update(row_digest_bytes)
    return hasher.hexdigest()


@functools.lru_cache(maxsize=4096)
def _combine_header(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    # cached: a recorded step repeats a few shapes hundreds of times
    return _HEADER_MAGIC + dtype_name(dtype).encode() + b"\0" + struct.pack(
        f"<q{len(shape)}q", len(shape), *(int(s) for s in shape)
    )


def fingerprint(tensor: torch.Tensor) -> str:
    """Bitwise-exact digest of a tensor: 32 hex characters covering dtype, shape and contents.

    tensor: any shape (0-d and empty included), dtype bool / int / uint / float16 / bfloat16 /
    float32 / float64 / float8, any device (CUDA: rows are digested on the device), dense (strided).
    Raises ArgumentError for what is not a tensor, UnsupportedDtypeError for another dtype, a sparse or
    nested tensor, or a meta tensor.
    """
    rows_R = row_digests_async(tensor).cpu()  # (first: it checks the argument)
    return combine(tensor.dtype, tensor.shape, rows_R)


def row_fingerprints(tensor: torch.Tensor) -> torch.Tensor:
    """One 64-bit digest per row: uint64 [R] on the host, R = product of the leading dims.

    tensor: [..., N] of a supported dtype; a 0-d tensor gives one digest. Equal rows (same dtype, same
    N, same bits) give equal digests wherever they sit, which is what content alignment relies on.
    """
    return row_digests_async(tensor).cpu().view(torch.uint64)
