"""The expert schedule: slots grouped by expert (a stable sort, no atomics) and the row tiles of each GEMM.

Shapes: docs/shapes.md. Slot n = t * K + k; `sorted_slots_N` lists the N slots grouped by expert,
stable (inside an expert in slot order), so an expert's rows are in the same order whatever the batch.
Integer work only: the kernel path (two launches of one program per expert, up to
configs.SCHEDULE_KERNEL_MAX_SLOTS slots) and the torch path (sort + searchsorted) give the same integers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok.kernels.launch import cached_launch
from mok.kernels.layout import last_dim_contiguous
from mok.kernels.moe import configs


@triton.jit
def valid_ids(ids_ptr, tokens, num_tokens, num_experts, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Experts [CHUNK_T, BLOCK_K] of `tokens` (num_experts where masked). A token with any id outside
    [0, num_experts) goes to experts 0..K-1 instead (slot t * K + k to expert k): its weights are NaN in the
    combine, so its row is NaN (docs/contracts.md, "Routing"), and no slot lands outside the expert ranges."""
    offs_k = tl.arange(0, BLOCK_K)
    mask = (tokens[:, None] < num_tokens) & (offs_k[None, :] < TOP_K)
    ids = tl.load(ids_ptr + tokens[:, None] * TOP_K + offs_k[None, :], mask=mask, other=0)
    invalid = tl.max(((ids < 0) | (ids >= num_experts)).to(tl.int32), axis=1)
    ids = tl.where(invalid[:, None] > 0, offs_k[None, :], ids)
    return tl.where(mask, ids, num_experts)


@cached_launch
@triton.jit
def _sort_kernel(ids_ptr, sorted_slots_ptr, expert_start_ptr, num_tokens, num_experts,
                 TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK_T: tl.constexpr):
    """Program e: expert e's start (the slots of lower experts) and its slots in slot order, i.e. a stable
    counting sort of the slots by expert with one program per expert and no atomics. Two passes over the
    ids: count, then place (an expert without slots skips the second). Writes expert_start[e] (and
    expert_start[E] from the last program) and sorted_slots[start_e : start_e + count_e]."""
    expert = tl.program_id(0)
    offs_t = tl.arange(0, CHUNK_T)
    offs_k = tl.arange(0, BLOCK_K)
    below = tl.zeros([CHUNK_T, BLOCK_K], dtype=tl.int32)
    mine = tl.zeros([CHUNK_T, BLOCK_K], dtype=tl.int32)
    for t0 in range(0, num_tokens, CHUNK_T):
        ids = valid_ids(ids_ptr, t0 + offs_t, num_tokens, num_experts, TOP_K, BLOCK_K)
        below += (ids < expert).to(tl.int32)
        mine += (ids == expert).to(tl.int32)
    start = tl.sum(tl.sum(below, axis=1), axis=0)
    count = tl.sum(tl.sum(mine, axis=1), axis=0)
    tl.store(expert_start_ptr + expert, start)
    if expert == num_experts - 1:
        tl.store(expert_start_ptr + num_experts, start + count)
    if count > 0:
        position = start
        for t0 in range(0, num_tokens, CHUNK_T):
            tokens = t0 + offs_t
            hit = (valid_ids(ids_ptr, tokens, num_tokens, num_experts, TOP_K, BLOCK_K) == expert).to(tl.int32)
            per_token = tl.sum(hit, axis=1)
            rank = (tl.cumsum(per_token, 0) - per_token)[:, None] + tl.cumsum(hit, axis=1) - hit
            tl.store(sorted_slots_ptr + position + rank, tokens[:, None] * TOP_K + offs_k[None, :], mask=hit > 0)
            position += tl.sum(per_token, axis=0)


@cached_launch
@triton.jit
def _tiles_kernel(expert_start_ptr, tile_expert_ptr, tile_row_start_ptr, num_tiles_ptr, num_experts, max_tiles,
                  BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """Program e: the row tiles of BLOCK_M rows of expert e (its first tile is the tiles of lower experts),
    exactly as Schedule.tiles computes them; the last program also fills the tiles past num_tiles as the
    torch path's clamped search does (expert E - 1, rows continuing), so every integer equals the torch path's."""
    expert = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < num_experts
    start_E = tl.load(expert_start_ptr + offs_e, mask=mask_e, other=0)
    tiles_E = (tl.load(expert_start_ptr + offs_e + 1, mask=mask_e, other=0) - start_E + BLOCK_M - 1) // BLOCK_M
    first_E = tl.cumsum(tiles_E, 0) - tiles_E
    mine = offs_e == expert
    first = tl.sum(tl.where(mine, first_E, 0), axis=0)
    row_start = tl.sum(tl.where(mine, start_E, 0), axis=0)
    num_tiles = tl.sum(tiles_E, axis=0)
    if expert == 0:
        tl.store(num_tiles_ptr, num_tiles)
    mine_tiles = tl.where(expert == num_experts - 1, max_tiles - first, tl.sum(tl.where(mine, tiles_E, 0), axis=0))
    offs_c = tl.arange(0, CHUNK)
    for i0 in range(0, mine_tiles, CHUNK):
        tiles = i0 + offs_c
        mask = tiles < mine_tiles
        tl.store(tile_expert_ptr + first + tiles, tl.zeros_like(tiles) + expert, mask=mask)
        tl.store(tile_row_start_ptr + first + tiles, row_start + tiles * BLOCK_M, mask=mask)


@cached_launch
@triton.jit
def _row_of_slot_kernel(sorted_slots_ptr, row_of_slot_ptr, num_slots, BLOCK: tl.constexpr):
    """row_of_slot[sorted_slots[i]] = i: the inverse permutation (distinct targets, no atomics)."""
    positions = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = positions < num_slots
    slots = tl.load(sorted_slots_ptr + positions, mask=mask, other=0)
    tl.store(row_of_slot_ptr + slots, positions, mask=mask)


@cached_launch
@triton.jit
def _gather_token_rows_kernel(x_ptr, sorted_slots_ptr, out_ptr, hidden, stride_xt, stride_on,
                              TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[i] = x[sorted_slots[i] // K]: each schedule position's token row (a copy). One program per (position,
    column block)."""
    position = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < hidden
    token = tl.load(sorted_slots_ptr + position).to(tl.int64) // TOP_K
    row = tl.load(x_ptr + token * stride_xt + offs_h, mask=mask_h)
    tl.store(out_ptr + position * stride_on + offs_h, row, mask=mask_h)


def neutralize_ids(ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """ids [T, K] with every token that has an id outside [0, num_experts) sent to experts 0..K-1 (torch ops on
    the device, no sync; the schedule kernels do the same in valid_ids). Replayed ids are range-checked
    on the host only on the CPU (mok/ops/checks.py); the combine gives such a token NaN weights."""
    top_k = ids_TK.shape[-1]
    invalid_T1 = ((ids_TK < 0) | (ids_TK >= num_experts)).any(dim=-1, keepdim=True)
    return torch.where(invalid_T1, torch.arange(top_k, device=ids_TK.device, dtype=ids_TK.dtype), ids_TK)


def uses_kernel(num_slots: int, num_experts: int) -> bool:
    """Whether _sort_kernel and _tiles_kernel build the schedule (small batches), not the torch path."""
    return 0 < num_slots <= configs.SCHEDULE_KERNEL_MAX_SLOTS and num_experts <= configs.SCHEDULE_KERNEL_MAX_EXPERTS


def max_row_tiles(num_slots: int, num_experts: int, block_m: int) -> int:
    """Row tiles of block_m rows, at most: each non-empty expert wastes less than one tile (no sync needed)."""
    return max(1, triton.cdiv(num_slots, block_m) + min(num_experts, num_slots))


_BUFFER_ALIGN = 64  # int32 elements (256 bytes): each array of `buffer_i32` starts as aligned as an allocation would


def _aligned(numel: int) -> int:
    return -(-numel // _BUFFER_ALIGN) * _BUFFER_ALIGN


def _carve(buffer_i32: torch.Tensor, *sizes: int) -> list[torch.Tensor]:
    """Views of `sizes` elements each, one after another, each from an aligned element."""
    views, offset = [], 0
    for numel in sizes:
        views.append(buffer_i32[offset:offset + numel])
        offset += _aligned(numel)
    return views


def kernel_buffer_numel(num_slots: int, num_experts: int, block_m: int) -> int:
    """int32 elements of Schedule's `buffer_i32` (sorted_slots, expert_start, the tiles of block_m and
    num_tiles of the kernel path, each 256-byte aligned); 0 when the torch path builds the schedule."""
    if not uses_kernel(num_slots, num_experts):
        return 0
    tiles = max_row_tiles(num_slots, num_experts, block_m)
    return _aligned(num_slots) + _aligned(num_experts + 1) + 2 * _aligned(tiles) + _aligned(1)


class Schedule:
    """Slots grouped by expert (stable) and the row tiles of one BLOCK_M, all on the device (no sync).

    sorted_slots_N int32 [N]; expert_start int32 [E + 1] (expert e's rows are schedule positions
    expert_start[e]:expert_start[e + 1]); per row tile: expert and first schedule position
    (int32 [max_tiles]); num_tiles int32 [1] (the valid prefix of the tile arrays).
    Small batches (<= configs.SCHEDULE_KERNEL_MAX_SLOTS slots) build it with _sort_kernel and one
    _tiles_kernel launch per BLOCK_M (`block_m`: the first tiles to build with the schedule); the torch
    path gives the same integers. With sorted_slots_N and expert_start given (the backward), only tiles are built.
    A token with an id outside [0, E) is scheduled on experts 0..K-1 (neutralize_ids; both paths).
    `buffer_i32` (with block_m; kernel_buffer_numel elements, contiguous int32): the kernel path's
    arrays are views of it instead of five allocations (same launch, same integers); the torch path
    ignores it.
    """

    def __init__(self, ids_TK: torch.Tensor, num_experts: int, sorted_slots_N: torch.Tensor | None = None,
                 expert_start: torch.Tensor | None = None, block_m: int | None = None,
                 buffer_i32: torch.Tensor | None = None):
        self.num_slots = ids_TK.numel()
        self.num_experts = num_experts
        device = ids_TK.device
        self._tiles: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = {}
        self._use_kernel = uses_kernel(self.num_slots, num_experts)
        if sorted_slots_N is None:
            self.top_k = ids_TK.shape[-1]
            if self.top_k > num_experts:  # an invalid token's slots go to experts 0..K-1: they must exist
                raise ValueError(f"top_k {self.top_k} > {num_experts} experts")
            if self._use_kernel and block_m is not None:
                if buffer_i32 is not None:
                    self.sorted_slots_N, self.expert_start, buffer_i32 = _carve(
                        buffer_i32, self.num_slots, num_experts + 1, buffer_i32.numel())
                else:
                    self.sorted_slots_N = torch.empty(self.num_slots, device=device, dtype=torch.int32)
                    self.expert_start = torch.empty(num_experts + 1, device=device, dtype=torch.int32)
                ids_N = ids_TK.reshape(-1)
                if ids_N.dtype != torch.int32:  # an int64 id must not wrap into [0, E) in the cast
                    ids_N = ids_N.clamp(-1, num_experts)
                self._launch(block_m, ids_N.to(torch.int32), buffer_i32)
                return
            ids_TK = neutralize_ids(ids_TK, num_experts)
            sorted_ids_N, sorted_slots_N = torch.sort(ids_TK.reshape(-1).to(torch.int32), stable=True)
            expert_start = torch.searchsorted(
                sorted_ids_N, torch.arange(num_experts + 1, device=device, dtype=torch.int32), out_int32=True)
        self.sorted_slots_N = sorted_slots_N.to(torch.int32)
        self.expert_start = expert_start.to(torch.int32)

    def _max_tiles(self, block_m: int) -> int:
        return max_row_tiles(self.num_slots, self.num_experts, block_m)

    def _launch(self, block_m: int, ids_N: torch.Tensor | None, buffer_i32: torch.Tensor | None = None) -> None:
        """_sort_kernel (ids_N, the experts in slot order, given) then _tiles_kernel for block_m. buffer_i32:
        the rest of Schedule's buffer_i32, for the tile arrays (else allocated)."""
        device = self.expert_start.device
        max_tiles = self._max_tiles(block_m)
        if buffer_i32 is not None:
            tile_expert, tile_row_start, num_tiles = _carve(buffer_i32, max_tiles, max_tiles, 1)
        else:
            tile_expert = torch.empty(max_tiles, device=device, dtype=torch.int32)
            tile_row_start = torch.empty(max_tiles, device=device, dtype=torch.int32)
            num_tiles = torch.empty(1, device=device, dtype=torch.int32)
        launch = configs.SCHEDULE_KERNEL
        if ids_N is not None:
            block_k = triton.next_power_of_2(self.top_k)
            _sort_kernel[(self.num_experts,)](
                ids_N, self.sorted_slots_N, self.expert_start, self.num_slots // self.top_k, self.num_experts,
                TOP_K=self.top_k, BLOCK_K=block_k, CHUNK_T=max(1, launch["sort_chunk_slots"] // block_k),
                num_warps=launch["num_warps"])
        _tiles_kernel[(self.num_experts,)](
            self.expert_start, tile_expert, tile_row_start, num_tiles, self.num_experts, max_tiles,
            BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(self.num_experts), CHUNK=launch["tile_chunk"],
            num_warps=launch["num_warps"])
        self._tiles[block_m] = (tile_expert, tile_row_start, num_tiles, max_tiles)

    def row_of_slot(self) -> torch.Tensor:
        """int32 [N]: the schedule position of each slot (the inverse of sorted_slots_N), one launch."""
        rows_N = torch.empty(self.num_slots, device=self.sorted_slots_N.device, dtype=torch.int32)
        if self.num_slots:
            block = configs.MOVE_ROWS["index_block"]
            _row_of_slot_kernel[(triton.cdiv(self.num_slots, block),)](
                self.sorted_slots_N, rows_N, self.num_slots, BLOCK=block, num_warps=4)
        return rows_N

    def gather_token_rows(self, x_TH: torch.Tensor, top_k: int) -> torch.Tensor:
        """[N, H]: row i is x_TH's row of the token of schedule position i (x in schedule order; a copy)."""
        x_TH = last_dim_contiguous(x_TH)
        hidden = x_TH.shape[1]
        out_NH = torch.empty(self.num_slots, hidden, device=x_TH.device, dtype=x_TH.dtype)
        if self.num_slots and hidden:
            block_h = min(configs.MOVE_ROWS["row_block"], triton.next_power_of_2(hidden))
            _gather_token_rows_kernel[(self.num_slots, triton.cdiv(hidden, block_h))](
                x_TH, self.sorted_slots_N, out_NH, hidden, x_TH.stride(0), out_NH.stride(0), TOP_K=top_k,
                BLOCK_H=block_h, num_warps=4)
        return out_NH

    def tiles(self, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """-> (tile_expert, tile_row_start, num_tiles, max_tiles) of row tiles of block_m rows."""
        if block_m not in self._tiles and self._use_kernel:
            self._launch(block_m, None)
        if block_m not in self._tiles:
            device = self.expert_start.device
            start = self.expert_start.long()
            counts = start[1:] - start[:-1]
            tiles_per_expert = (counts + block_m - 1) // block_m
            tile_end = torch.cumsum(tiles_per_expert, 0)
            max_tiles = self._max_tiles(block_m)
            tile_ids = torch.arange(max_tiles, device=device)
            expert = torch.searchsorted(tile_end, tile_ids, right=True).clamp_(max=self.num_experts - 1)
            first_tile = tile_end[expert] - tiles_per_expert[expert]
            row_start = start[expert] + (tile_ids - first_tile) * block_m
            num_tiles = tile_end[-1:].to(torch.int32)
            self._tiles[block_m] = (expert.to(torch.int32), row_start.to(torch.int32), num_tiles, max_tiles)
        return self._tiles[block_m]

    def gemm_rows(self, block_m: int) -> tuple[int, tuple, dict]:
        """For the GEMM kernels' row tiles of block_m rows: (row programs (max_tiles), the row-source arguments
        (ids, sorted_slots, expert_start, tile_expert, tile_row_start, num_tiles, max_tiles, num_experts; the
        ids are unused here), their constexprs). ScannedRoutes gives the scanning variant's."""
        tile_expert, tile_row_start, num_tiles, max_tiles = self.tiles(block_m)
        row_source = (self.sorted_slots_N, self.sorted_slots_N, self.expert_start, tile_expert, tile_row_start,
                      num_tiles, max_tiles, self.num_experts)
        return max_tiles, row_source, dict(SCANNED=False, BLOCK_T=1, BLOCK_KP=1)


class ScannedRoutes:
    """Small batches without a schedule: the GEMM kernels scan the ids themselves (grouped_gemm.py,
    _scanned_tile_rows), so routing -> GEMM 1 -> GEMM 2 -> combine is four launches instead of six (three for
    up to configs.ROUTE_IN_GEMM1_MAX_TOKENS tokens, where GEMM 1 routes them itself: launch_gemm1's `route`).

    A program per (slot, column tile) finds its slot's expert and rank among that expert's slots (in slot
    order, the order the schedule sorts them into); the slot whose rank is a multiple of BLOCK_M runs the
    tile of that expert's next BLOCK_M slots, the tile the schedule would build; the others return. Rows are
    in slot order (gate_up, act and y alike). Ids outside [0, E) are neutralised as the schedule does
    (valid_ids). The scan reads every id per program: for up to configs.SCAN_MAX_SLOTS slots only.
    """

    def __init__(self, ids_TK: torch.Tensor, num_experts: int):
        self.num_slots = ids_TK.numel()
        self.num_experts = num_experts
        self.top_k = ids_TK.shape[-1]
        if self.top_k > num_experts:
            raise ValueError(f"top_k {self.top_k} > {num_experts} experts")
        self.ids_N = ids_TK.contiguous().view(-1)

    def gemm_rows(self, block_m: int) -> tuple[int, tuple, dict]:
        """As Schedule.gemm_rows: one row program per slot; of the arguments only the ids, the slot count (in
        max_tiles' place) and E are read."""
        ids = self.ids_N
        row_source = (ids, ids, ids, ids, ids, ids, self.num_slots, self.num_experts)
        block_t = triton.next_power_of_2(max(1, self.num_slots // self.top_k))
        return self.num_slots, row_source, dict(SCANNED=True, BLOCK_T=block_t,
                                                BLOCK_KP=triton.next_power_of_2(self.top_k))


def scans_routes(num_slots: int) -> bool:
    """Whether moe_infer lets the GEMMs scan the routes (ScannedRoutes) instead of building a Schedule."""
    return 0 < num_slots <= configs.SCAN_MAX_SLOTS
