"""The Triton kernels of the attention forward behind mok.attention / mok.paged_attention (varlen queries, packed
or paged keys), and of write_kv_cache. Design and launchers: mok/kernels/attention.py.

Shapes: docs/shapes.md. Semantics and rounding points: mok/reference/attention.py.
"""
from __future__ import annotations

import triton
import triton.language as tl

from mok.kernels.launch import cached_launch


@triton.jit
def _tile_of_program(cu_ptr, program, num_seqs, BLOCK: tl.constexpr):
    """-> (sequence b, tile index j inside it, first row of b, row count of b) for `program`."""
    lo = num_seqs * 0
    hi = num_seqs + 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        start_mid = tl.load(cu_ptr + mid) // BLOCK + mid
        go_up = start_mid <= program
        lo = tl.where(go_up, mid, lo)
        hi = tl.where(go_up, hi, mid)
    row_start = tl.load(cu_ptr + lo)
    num_rows = tl.load(cu_ptr + lo + 1) - row_start
    return lo, program - (row_start // BLOCK + lo), row_start.to(tl.int64), num_rows.to(tl.int64)


@triton.jit
def _key_slots(n_N, key_start, seq, block_table_ptr, stride_table, PAGED: tl.constexpr, PAGE: tl.constexpr):
    """(page, slot) of keys n_N of a sequence: packed keys are page 0, slot key_start + n; paged keys go
    through its block table. Address = page * page stride + slot * slot stride, so any page stride works."""
    if PAGED:
        page_N = tl.load(block_table_ptr + seq * stride_table + n_N // PAGE)
        return page_N.to(tl.int64), n_N % PAGE
    return n_N * 0, key_start + n_N


@triton.jit
def _scaled(x, scale, INTERPRET: tl.constexpr):
    """x * scale rounded once, never contracted into a later add (ptxas fuses a plain multiply into an
    FMA in some code paths and not in others, which would make the bits depend on the path)."""
    if INTERPRET:
        return x * scale
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [x, tl.full(x.shape, scale, tl.float32)],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _scores(q_MD, k_DN, q_MT, k_TN, TAIL: tl.constexpr):
    """q . k in fp32 for a [M, N] tile: the head's first BLOCK_D features, then (TAIL) the rest, accumulated into
    the same sum (mok/kernels/attention.py split_head: a head over 256 wide that is no power of two, MLA's 512 + 64)."""
    s_MN = tl.dot(q_MD, k_DN, input_precision="ieee")
    if TAIL:
        s_MN = tl.dot(q_MT, k_TN, s_MN, input_precision="ieee")
    return s_MN


@triton.jit
def _softmax_block(q_MD, k_DN, q_MT, k_TN, v_NW, acc_MW, max_M, sum_M, scale, keep_MN, MASKED: tl.constexpr,
                   TAIL: tl.constexpr, INTERPRET: tl.constexpr):
    """One semantic key block of the online softmax (mok/reference/attention.py), in fp32.

    The row sum of p is a tensor-core dot with ones, like the p @ v it normalises: a reduction with
    tl.sum would follow the register layout, which changes with the tile shape and the warp count."""
    s_MN = _scaled(_scores(q_MD, k_DN, q_MT, k_TN, TAIL), scale, INTERPRET)
    if MASKED:
        s_MN = tl.where(keep_MN, s_MN, float("-inf"))
    max_new_M = tl.maximum(max_M, tl.max(s_MN, 1))
    alpha_M = tl.exp(max_M - max_new_M)
    p_MN = tl.exp(s_MN - max_new_M[:, None]).to(v_NW.dtype)
    ones_N16 = tl.full((v_NW.shape[0], 16), 1.0, v_NW.dtype)
    sum_M = sum_M * alpha_M + tl.max(tl.dot(p_MN, ones_N16, input_precision="ieee"), 1)
    acc_MW = acc_MW * alpha_M[:, None]
    acc_MW = tl.dot(p_MN, v_NW, acc_MW, input_precision="ieee")
    return acc_MW, max_new_M, sum_M


@cached_launch
@triton.jit
def _attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, k_desc, v_desc, out_ptr, lse_ptr, cu_q_ptr, keys_ptr, block_table_ptr,
    num_seqs, scale,
    stride_qt, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_lt, stride_table,
    GROUP: tl.constexpr, PACK: tl.constexpr, CAUSAL: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr,
    USE_TMA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TAIL: tl.constexpr, BLOCK_T: tl.constexpr,
    VALUE_DIM: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_M: tl.constexpr, KEY_BLOCK: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, INTERPRET: tl.constexpr,
):
    # keys_ptr: cu_seqlens_k [B + 1] (packed keys) or seq_lens_k [B] (paged keys). q and k features
    # [0, BLOCK_D) are the head's first part, [BLOCK_D, BLOCK_D + BLOCK_T) its tail (TAIL); values have VALUE_DIM.
    BLOCK_Q: tl.constexpr = BLOCK_M // PACK
    seq, tile, q_start, len_q = _tile_of_program(cu_q_ptr, tl.program_id(0), num_seqs, BLOCK_Q)
    num_tiles = tl.cdiv(len_q, BLOCK_Q)
    if tile >= num_tiles:
        return
    q_tile = num_tiles - 1 - tile  # the tile with the most keys first
    head_chunk = tl.program_id(1)  # PACK consecutive query heads of one group
    kv_head = head_chunk * PACK // GROUP
    if PAGED:
        key_start = 0
        len_k = tl.load(keys_ptr + seq).to(tl.int64)
    else:
        key_start = tl.load(keys_ptr + seq).to(tl.int64)
        len_k = tl.load(keys_ptr + seq + 1).to(tl.int64) - key_start

    rows_M = tl.arange(0, BLOCK_M)
    query_M = q_tile * BLOCK_Q + rows_M // PACK
    head_M = head_chunk * PACK + rows_M % PACK
    row_ok_M = query_M < len_q
    d_D = tl.arange(0, BLOCK_D)
    d_ok_D = d_D < HEAD_DIM
    t_T = BLOCK_D + tl.arange(0, BLOCK_T)
    t_ok_T = t_T < HEAD_DIM
    w_W = tl.arange(0, BLOCK_W)
    w_ok_W = w_W < VALUE_DIM
    q_rows_M = (q_start + query_M) * stride_qt + head_M * stride_qh
    q_MD = tl.load(q_ptr + q_rows_M[:, None] + d_D[None, :], mask=row_ok_M[:, None] & d_ok_D[None, :], other=0.0)
    if TAIL:
        q_MT = tl.load(q_ptr + q_rows_M[:, None] + t_T[None, :], mask=row_ok_M[:, None] & t_ok_T[None, :], other=0.0)
    else:
        q_MT = q_MD  # (unused)

    first_query = q_tile * BLOCK_Q
    last_query = tl.minimum(first_query + BLOCK_Q, len_q) - 1
    if CAUSAL:
        visible_M = len_k - len_q + query_M + 1
        key_end = len_k - len_q + last_query + 1
        full_end = (len_k - len_q + first_query + 1) // KEY_BLOCK * KEY_BLOCK
    else:
        visible_M = tl.zeros((BLOCK_M,), tl.int64) + len_k
        key_end = len_k
        full_end = len_k // KEY_BLOCK * KEY_BLOCK

    max_M = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    sum_M = tl.zeros((BLOCK_M,), tl.float32)
    acc_MW = tl.zeros((BLOCK_M, BLOCK_W), tl.float32)
    n_base = tl.arange(0, KEY_BLOCK).to(tl.int64)
    # blocks every row of the tile sees in full: no mask (WARP_SPECIALIZE: Triton's producer / consumer warps, the
    # same dots in the same order)
    for start_n in tl.range(0, full_end, KEY_BLOCK, warp_specialize=WARP_SPECIALIZE):
        if USE_TMA:  # (no tail, VALUE_DIM == HEAD_DIM: the launcher's condition)
            k_ND = k_desc.load([(key_start + start_n).to(tl.int32), (kv_head * HEAD_DIM).to(tl.int32)])
            v_NW = v_desc.load([(key_start + start_n).to(tl.int32), (kv_head * HEAD_DIM).to(tl.int32)])
            k_DN = tl.trans(k_ND)
            k_TN = k_DN
        else:
            page_N, slot_N = _key_slots(start_n + n_base, key_start, seq, block_table_ptr, stride_table, PAGED, PAGE)
            k_keys_N = page_N * stride_kp + slot_N * stride_kt + kv_head * stride_kh
            k_DN = tl.load(k_ptr + k_keys_N[None, :] + d_D[:, None], mask=d_ok_D[:, None], other=0.0)
            if TAIL:
                k_TN = tl.load(k_ptr + k_keys_N[None, :] + t_T[:, None], mask=t_ok_T[:, None], other=0.0)
            else:
                k_TN = k_DN
            v_NW = tl.load(v_ptr + (page_N * stride_vp + slot_N * stride_vt)[:, None] + kv_head * stride_vh
                           + w_W[None, :], mask=w_ok_W[None, :], other=0.0)
        acc_MW, max_M, sum_M = _softmax_block(q_MD, k_DN, q_MT, k_TN, v_NW, acc_MW, max_M, sum_M, scale, None,
                                              False, TAIL, INTERPRET)
    # the diagonal: masked per row (pointer loads, so no key of another sequence is ever read)
    for start_n in range(full_end, key_end, KEY_BLOCK):
        n_N = start_n + n_base
        key_ok_N = n_N < len_k
        page_N, slot_N = _key_slots(tl.where(key_ok_N, n_N, 0), key_start, seq, block_table_ptr, stride_table,
                                    PAGED, PAGE)
        k_keys_N = page_N * stride_kp + slot_N * stride_kt + kv_head * stride_kh
        k_DN = tl.load(k_ptr + k_keys_N[None, :] + d_D[:, None], mask=key_ok_N[None, :] & d_ok_D[:, None], other=0.0)
        if TAIL:
            k_TN = tl.load(k_ptr + k_keys_N[None, :] + t_T[:, None], mask=key_ok_N[None, :] & t_ok_T[:, None],
                           other=0.0)
        else:
            k_TN = k_DN
        v_NW = tl.load(v_ptr + (page_N * stride_vp + slot_N * stride_vt)[:, None] + kv_head * stride_vh
                       + w_W[None, :], mask=key_ok_N[:, None] & w_ok_W[None, :], other=0.0)
        keep_MN = (n_N[None, :] < visible_M[:, None]) & key_ok_N[None, :]
        acc_MW, max_M, sum_M = _softmax_block(q_MD, k_DN, q_MT, k_TN, v_NW, acc_MW, max_M, sum_M, scale, keep_MN,
                                              True, TAIL, INTERPRET)

    out_MW = acc_MW / sum_M[:, None]
    tl.store(out_ptr + (q_start + query_M)[:, None] * stride_ot + head_M[:, None] * stride_oh + w_W[None, :],
             out_MW.to(out_ptr.dtype.element_ty), mask=row_ok_M[:, None] & w_ok_W[None, :])
    tl.store(lse_ptr + (q_start + query_M) * stride_lt + head_M, max_M + tl.log(sum_M), mask=row_ok_M)


@cached_launch
@triton.jit
def _write_kv_cache_kernel(k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, slot_ptr, stride_kt, stride_kg, stride_vt,
                           stride_vg, stride_cp, stride_cz, stride_cg, stride_vcp, stride_vcz, stride_vcg,
                           NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
                           BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr, PAGE: tl.constexpr):
    """One program per token: its K and V rows into its cache slot; a negative slot (padding) writes nothing."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    page = slot // PAGE
    offset = slot % PAGE
    g_G = tl.arange(0, BLOCK_G)
    d_D = tl.arange(0, BLOCK_D)
    w_W = tl.arange(0, BLOCK_W)
    mask = (g_G < NUM_KV_HEADS)[:, None] & (d_D < HEAD_DIM)[None, :]
    v_mask = (g_G < NUM_KV_HEADS)[:, None] & (w_W < VALUE_DIM)[None, :]
    k_GD = tl.load(k_ptr + token * stride_kt + g_G[:, None] * stride_kg + d_D[None, :], mask=mask)
    v_GW = tl.load(v_ptr + token * stride_vt + g_G[:, None] * stride_vg + w_W[None, :], mask=v_mask)
    tl.store(key_cache_ptr + page * stride_cp + offset * stride_cz + g_G[:, None] * stride_cg + d_D[None, :],
             k_GD.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + page * stride_vcp + offset * stride_vcz + g_G[:, None] * stride_vcg + w_W[None, :],
             v_GW.to(value_cache_ptr.dtype.element_ty), mask=v_mask)
