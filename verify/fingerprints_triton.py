"""Row digests on the device (Triton): the definition of `verify/fingerprints.py`, bit for bit.

Legend: R = rows, N = elements per row, W = 64-bit words per row, P = elements packed per word
(8 / itemsize; 1 when the row is read directly as int64 words), C = column chunks per row.

Reads kernel -> launcher -> adapter. Each program sums mix64(word ^ key) over BLOCK_R rows and one
chunk of words; wrapping integer addition makes the result independent of how rows are split into
chunks and tiles. When a row is split into C > 1 chunks, the partial sums go to a [R, C] buffer and a
second kernel adds them and finalizes. Only the [R] digests ever leave the device.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _mix64(z):
    # splitmix64 finalizer on uint64 (wrapping multiply, logical shifts).
    z = z ^ (z >> 30)
    z = z * 0xBF58476D1CE4E5B9
    z = z ^ (z >> 27)
    z = z * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    return z


@triton.jit
def _row_sums(x_ptr, rows_R, n_rows, n_elems, n_words, stride_row, stride_col, chunk_start, words_per_chunk,
              words_to_read, PACK: tl.constexpr, ELEM_BITS: tl.constexpr, BLOCK_R: tl.constexpr,
              BLOCK_W: tl.constexpr):
    # sum over words j of this chunk of mix64(word_j ^ key_j), per row: wrapping uint64 adds, so any split of a row
    # into chunks, and any order, gives the same sum
    row_ok_R = rows_R < n_rows
    row_off_R = rows_R.to(tl.int64) * stride_row
    acc_R = tl.zeros([BLOCK_R], dtype=tl.uint64)
    # key_j = (j + 1) * GOLDEN = (tile start) * GOLDEN + (offset in tile + 1) * GOLDEN: one scalar
    # multiply per tile instead of one 64-bit multiply per word.
    key_off_W = (tl.arange(0, BLOCK_W).to(tl.uint64) + 1) * 0x9E3779B97F4A7C15
    for w0 in range(0, words_to_read, BLOCK_W):
        in_chunk_W = w0 + tl.arange(0, BLOCK_W)
        words_W = chunk_start + in_chunk_W
        ok_RW = row_ok_R[:, None] & ((in_chunk_W < words_per_chunk) & (words_W < n_words))[None, :]
        if PACK == 1:
            bits_RW = tl.load(x_ptr + row_off_R[:, None] + (words_W * stride_col)[None, :], mask=ok_RW, other=0)
            word_RW = bits_RW.to(tl.uint64, bitcast=True)
        else:
            lane_P = tl.arange(0, PACK)
            elems_WP = words_W[:, None] * PACK + lane_P[None, :]
            ok_RWP = ok_RW[:, :, None] & (elems_WP < n_elems)[None, :, :]
            bits_RWP = tl.load(
                x_ptr + row_off_R[:, None, None] + (elems_WP * stride_col)[None, :, :], mask=ok_RWP, other=0
            )
            if ELEM_BITS == 8:
                lanes_RWP = bits_RWP.to(tl.uint8, bitcast=True)
            elif ELEM_BITS == 16:
                lanes_RWP = bits_RWP.to(tl.uint16, bitcast=True)
            else:
                lanes_RWP = bits_RWP.to(tl.uint32, bitcast=True)
            shift_P = lane_P.to(tl.uint64) * ELEM_BITS
            # Lanes occupy disjoint bit fields, so their sum is their little-endian packing.
            word_RW = tl.sum(lanes_RWP.to(tl.uint64) << shift_P[None, None, :], axis=2)
        key_W = key_off_W + (chunk_start + w0).to(tl.uint64) * 0x9E3779B97F4A7C15
        term_RW = _mix64(word_RW ^ key_W[None, :])
        acc_R += tl.sum(tl.where(ok_RW, term_RW, 0), axis=1)
    return acc_R


@triton.jit
def _row_digest_kernel(
    x_ptr, out_ptr, destination_ptr,
    n_rows, n_elems, n_words, stride_row, stride_col, words_per_chunk, tag_key,
    PACK: tl.constexpr, ELEM_BITS: tl.constexpr, FINALIZE: tl.constexpr, TO_RING: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):
    words_to_read = words_per_chunk
    if TO_RING:
        # A capture tap's entry (verify/capture.py): the rows go to the ring at the place _reserve_kernel left in
        # destination_ptr, -1 on steps its rate skips (a CUDA graph replays them anyway) or when the entry does
        # not fit; the loop then reads nothing and nothing is stored.
        destination = tl.load(destination_ptr)
        words_to_read = words_per_chunk * (destination >= 0).to(tl.int32)
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    n_chunks = tl.num_programs(1)
    rows_R = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    chunk_start = pid_c.to(tl.int64) * words_per_chunk
    acc_R = _row_sums(x_ptr, rows_R, n_rows, n_elems, n_words, stride_row, stride_col, chunk_start, words_per_chunk,
                      words_to_read, PACK, ELEM_BITS, BLOCK_R, BLOCK_W)
    if FINALIZE:
        acc_R = _mix64(acc_R ^ tag_key)
        if TO_RING:
            tl.store(out_ptr + destination + rows_R.to(tl.int64), acc_R.to(tl.int64, bitcast=True),
                     mask=rows_R < tl.where(destination >= 0, n_rows, 0))
        else:
            tl.store(out_ptr + rows_R.to(tl.int64), acc_R.to(tl.int64, bitcast=True), mask=rows_R < n_rows)
    else:
        tl.store(out_ptr + rows_R.to(tl.int64) * n_chunks + pid_c, acc_R.to(tl.int64, bitcast=True),
                 mask=rows_R < n_rows)


@triton.jit
def _finalize_kernel(partial_ptr, out_ptr, destination_ptr, n_rows, n_chunks, tag_key, TO_RING: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    chunks_to_read = n_chunks
    if TO_RING:  # as in _row_digest_kernel
        destination = tl.load(destination_ptr)
        chunks_to_read = n_chunks * (destination >= 0).to(tl.int32)
    rows_R = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok_R = rows_R < n_rows
    acc_R = tl.zeros([BLOCK_R], dtype=tl.uint64)
    for c0 in range(0, chunks_to_read, BLOCK_C):
        chunks_C = c0 + tl.arange(0, BLOCK_C)
        ok_RC = row_ok_R[:, None] & (chunks_C < n_chunks)[None, :]
        part_RC = tl.load(partial_ptr + rows_R.to(tl.int64)[:, None] * n_chunks + chunks_C[None, :], mask=ok_RC,
                          other=0)
        acc_R += tl.sum(part_RC.to(tl.uint64, bitcast=True), axis=1)
    acc_R = _mix64(acc_R ^ tag_key)
    if TO_RING:
        tl.store(out_ptr + destination + rows_R.to(tl.int64), acc_R.to(tl.int64, bitcast=True),
                 mask=rows_R < tl.where(destination >= 0, n_rows, 0))
    else:
        tl.store(out_ptr + rows_R.to(tl.int64), acc_R.to(tl.int64, bitcast=True), mask=row_ok_R)


def launch_row_digests(
    bits_RN: torch.Tensor, key: int, pack: int, elem_bits: int, n_elems: int, n_words: int,
    block_r: int, block_w: int, n_chunks: int, words_per_chunk: int, num_warps: int = 4,
    ring: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """Launch on raw bits [R, N or W] (any strides); returns int64 [R] row digests on the same device.
    ring: (ring, state) of a capture tap instead: the digests go into the ring where _reserve_kernel placed the
    entry (state[3]; nothing where it holds -1), and None is returned."""
    rows = bits_RN.shape[0]
    finalize = n_chunks == 1
    if ring is None:
        out_R = torch.empty(rows, dtype=torch.int64, device=bits_RN.device)
        destination = out_R  # not read
    else:
        out_R, destination = ring[0], ring[1][3:]
    partial_RC = out_R if finalize else torch.empty(rows, n_chunks, dtype=torch.int64, device=bits_RN.device)
    grid = (triton.cdiv(rows, block_r), n_chunks)
    _row_digest_kernel[grid](
        bits_RN, partial_RC, destination, rows, n_elems, n_words, bits_RN.stride(0), bits_RN.stride(1),
        words_per_chunk, key, PACK=pack, ELEM_BITS=elem_bits, FINALIZE=finalize, TO_RING=ring is not None,
        BLOCK_R=block_r, BLOCK_W=block_w, num_warps=num_warps,
    )
    if not finalize:
        block_c = min(64, triton.next_power_of_2(n_chunks))
        _finalize_kernel[(triton.cdiv(rows, 16),)](partial_RC, out_R, destination, rows, n_chunks, key,
                                                   TO_RING=ring is not None, BLOCK_R=16, BLOCK_C=block_c)
    return None if ring is not None else out_R


# Tile sizes, chosen from the shape only (no autotuning): words per tile when reading int64 words
# directly, elements per tile when packing narrower elements in registers.
CONFIG = {"tile_words": 1024, "tile_elems_packed": 4096, "programs_per_sm": 4, "num_warps": 4}


def plan(rows: int, n_words: int, pack: int, n_sms: int) -> dict:
    """Tile and chunking for R rows of W words: enough programs to fill the device even for few rows."""
    tile_words = CONFIG["tile_words"] if pack == 1 else CONFIG["tile_elems_packed"] // pack
    block_w = min(triton.next_power_of_2(max(n_words, 1)), tile_words)
    block_r = max(1, min(triton.next_power_of_2(max(rows, 1)), tile_words // block_w))
    row_blocks = triton.cdiv(rows, block_r)
    target = CONFIG["programs_per_sm"] * n_sms
    n_chunks = 1
    if row_blocks < target:
        n_chunks = max(1, min(triton.cdiv(target, row_blocks), triton.cdiv(n_words, block_w)))
    words_per_chunk = triton.cdiv(triton.cdiv(n_words, n_chunks), block_w) * block_w
    n_chunks = max(1, triton.cdiv(n_words, words_per_chunk))
    return {"block_r": block_r, "block_w": block_w, "n_chunks": n_chunks, "words_per_chunk": words_per_chunk}


def row_digests_triton(bits_RN: torch.Tensor, key: int, n_sms: int | None = None,
                       plan_override: dict | None = None,
                       ring: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
    """Row digests of raw bits [R, N] (uint8/int16/int32/int64 view, any strides) -> int64 [R], same device.

    Rows whose bytes are contiguous and 8-byte aligned are read directly as int64 words; others are
    packed from their elements in registers. Both give the same digests by definition. ring: see
    launch_row_digests (rows of no bytes are allowed there: their digest is that of an empty row).
    """
    rows, row_len = bits_RN.shape
    n_words = (row_len * bits_RN.element_size() + 7) // 8
    if rows == 0 or (n_words == 0 and ring is None):
        raise ValueError(f"row_digests_triton needs rows with bytes, got [{rows}, {row_len}] "
                         "(row_digests_async fills empty ones)")
    src, pack, p = _source_and_plan(bits_RN, n_sms, plan_override)
    with torch.cuda.device(bits_RN.device) if bits_RN.is_cuda else _nullcontext():
        return launch_row_digests(
            src, key, pack, bits_RN.element_size() * 8, row_len, n_words,
            p["block_r"], p["block_w"], p["n_chunks"], p["words_per_chunk"], CONFIG["num_warps"], ring,
        )


def _source_and_plan(bits_RN: torch.Tensor, n_sms: int | None, plan_override: dict | None
                     ) -> tuple[torch.Tensor, int, dict]:
    """(what the kernel reads, elements packed per word, plan) for raw bits [R, N]: rows whose bytes are contiguous
    and 8-byte aligned are read as int64 words (pack 1)."""
    rows, row_len = bits_RN.shape
    itemsize = bits_RN.element_size()
    n_words = (row_len * itemsize + 7) // 8
    src, pack = bits_RN, 8 // itemsize
    if pack > 1 and (row_len * itemsize) % 8 == 0:
        try:
            src, pack = bits_RN.view(torch.int64), 1
        except RuntimeError:  # not contiguous along the row, or not 8-byte aligned: pack in registers
            pass
    if n_sms is None:
        n_sms = _sm_count(bits_RN.device.index) if bits_RN.is_cuda else 4
    return src, pack, plan_override or plan(rows, max(n_words, 1), pack, n_sms)  # no words: every load masked


@triton.jit
def _reserve(ring_ptr, state_ptr, capacity, n_rows, h0, h1, h2, h3, h4, h5, h6, h7, HEADER: tl.constexpr):
    # Run by one program, so that it alone reads and moves the cursor: state = [cursor, written, gate, destination].
    # Returns where the entry's rows go, -1 for nowhere (gate 0, or the entry does not fit).
    start = tl.load(state_ptr)
    total = (HEADER + n_rows) * (tl.load(state_ptr + 2) != 0).to(n_rows.dtype)  # gate 0: nothing appended
    fits = (total > 0) & (start + total <= capacity)
    if fits:
        offs = tl.arange(0, 8)
        values = tl.where(offs == 0, h0, tl.where(offs == 1, h1, tl.where(offs == 2, h2, tl.where(
            offs == 3, h3, tl.where(offs == 4, h4, tl.where(offs == 5, h5, tl.where(offs == 6, h6, h7)))))))
        tl.store(ring_ptr + start + offs, values.to(tl.int64), mask=offs < HEADER)
        tl.store(state_ptr + 1, start + total)
    destination = tl.where(fits, start + HEADER, -1)
    tl.store(state_ptr + 3, destination)
    tl.store(state_ptr, start + total)
    return destination


@triton.jit(do_not_specialize=["n_rows", "h0", "h1", "h2", "h3", "h4", "h5", "h6", "h7"])
def _reserve_kernel(ring_ptr, state_ptr, capacity, n_rows, h0, h1, h2, h3, h4, h5, h6, h7, HEADER: tl.constexpr):
    _reserve(ring_ptr, state_ptr, capacity, n_rows, h0, h1, h2, h3, h4, h5, h6, h7, HEADER)


@triton.jit(do_not_specialize=["n_rows", "h0", "h1", "h2", "h3", "h4", "h5", "h6", "h7"])
def _append_one_program_kernel(
    x_ptr, ring_ptr, state_ptr, capacity, n_rows, n_elems, n_words, stride_row, stride_col, words_per_chunk, tag_key,
    h0, h1, h2, h3, h4, h5, h6, h7,
    HEADER: tl.constexpr, PACK: tl.constexpr, ELEM_BITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):
    # An entry whose rows one program digests (a decode step's few rows): reserve and digest in one launch, half the
    # launches a CUDA graph replays for it on every step, recorded or not.
    destination = _reserve(ring_ptr, state_ptr, capacity, n_rows, h0, h1, h2, h3, h4, h5, h6, h7, HEADER)
    rows_R = tl.arange(0, BLOCK_R)
    chunk_start = tl.program_id(0).to(tl.int64) * words_per_chunk  # 0: the grid is one program
    acc_R = _row_sums(x_ptr, rows_R, n_rows, n_elems, n_words, stride_row, stride_col, chunk_start, words_per_chunk,
                      words_per_chunk * (destination >= 0).to(tl.int32), PACK, ELEM_BITS, BLOCK_R, BLOCK_W)
    acc_R = _mix64(acc_R ^ tag_key)
    tl.store(ring_ptr + destination + rows_R.to(tl.int64), acc_R.to(tl.int64, bitcast=True),
             mask=rows_R < tl.where(destination >= 0, n_rows, 0))


def append_row_digests(ring: torch.Tensor, state: torch.Tensor, header: list[int], bits_RN: torch.Tensor, key: int,
                       plan_override: dict | None = None) -> None:
    """Append [header..., row digests of bits_RN...] to `ring` at the device-side cursor `state[0]` without reading
    it on the host (CUDA-graph capturable): _reserve_kernel writes the header and moves the cursor, then the digest
    kernel stores each row's digest in the ring itself. An entry that does not fit is not written, but the cursor
    still moves past it while `state[1]` (the end of what was written) stays. Nothing happens while the gate
    `state[2]` is 0. state: int64 [4] = [cursor, written, gate, destination], the last where _reserve_kernel tells
    the digest kernel where the rows go (-1: nowhere). bits_RN: raw bits [R, N] on ring's device (bits_view)."""
    if len(header) > 8:
        raise ValueError(f"an entry header holds at most 8 values, got {len(header)}")
    values = list(header) + [0] * (8 - len(header))
    rows, row_len = bits_RN.shape
    with torch.cuda.device(ring.device) if ring.is_cuda else _nullcontext():
        if rows:
            src, pack, p = _source_and_plan(bits_RN, None, plan_override)
            if p["n_chunks"] == 1 and p["block_r"] >= rows:  # one program: reserve and digest in one launch
                _append_one_program_kernel[(1,)](
                    src, ring, state, ring.numel(), rows, row_len, (row_len * bits_RN.element_size() + 7) // 8,
                    src.stride(0), src.stride(1), p["words_per_chunk"], key, *values, HEADER=len(header), PACK=pack,
                    ELEM_BITS=bits_RN.element_size() * 8, BLOCK_R=p["block_r"], BLOCK_W=p["block_w"],
                    num_warps=CONFIG["num_warps"])
                return
        _reserve_kernel[(1,)](ring, state, ring.numel(), rows, *values, HEADER=len(header))
        if rows:
            row_digests_triton(bits_RN, key, plan_override=plan_override, ring=(ring, state))


@functools.cache
def _sm_count(device_index: int | None) -> int:
    index = device_index if device_index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None
