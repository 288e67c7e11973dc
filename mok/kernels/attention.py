"""Triton flash attention behind mok.attention: varlen forward (contiguous or paged keys), backward.

Shapes: docs/shapes.md. Semantics and rounding points: mok/reference/attention.py (the CPU path).

Forward. A program owns one tile of rows: BLOCK_M // PACK queries of one sequence times PACK query
heads of one key/value group (PACK > 1 packs a GQA group's heads into the tile, so a decode step
reads each key once for the whole group). It walks the sequence's keys from key 0 in semantic blocks
of KEY_BLOCK keys (`key_block_size(D)`), one online-softmax update per block, in order: a row's bits
depend on its q, its keys and KEY_BLOCK only, never on the tile, the batch or the path (prefill,
chunked prefill, decode; docs/contracts.md, Bitwise). Key blocks every row of the tile sees in full
run without a mask; the blocks on the causal diagonal run masked (a row's update on a block past its
last key is the identity: alpha = 1, p = 0). No split-KV. Tiles are ordered heaviest first.
Keys are either packed like the queries (`cu_seqlens_k`) or live in a paged cache (`block_table`,
page size Z); only the address of key n changes.

Backward (deterministic, not batch-invariant): delta = rowsum(dO * O) per row; one program per
(key tile, key/value head) accumulates dK and dV over the group's query heads and the query tiles in
order; one program per (query tile, query head) accumulates dQ over key tiles in order. P is
recomputed from the saved log-sum-exp (as exp2 of log2-scaled scores), so memory stays linear in the
sequence length. No atomics. Tiles every row of which sees every key of the other side's tile run
without masks (TMA loads where the layout allows); only the causal diagonal and a sequence's last
partial tile are masked.

Which sequence a program serves, without reading sizes on the host: the program range of sequence b
starts at cu[b] // BLOCK + b (strictly increasing in b, and each range holds at least
cdiv(len_b, BLOCK) programs), so T // BLOCK + B programs cover every tile and a binary search over
cu finds a program's sequence.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok.kernels.launch import INTERPRET, cached_launch
from mok.reference.attention import key_block_size

try:  # host-side TMA descriptors (Triton >= 3.4); without them the kernels use pointer loads
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None


LOG2E = tl.constexpr(1.4426950408889634)  # the backward's exponentials are exp2 of log2-scaled scores

# ============================================================================================
# kernels
# ============================================================================================


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
def _softmax_block(q_MD, k_DN, v_ND, acc_MD, max_M, sum_M, scale, keep_MN, MASKED: tl.constexpr,
                   INTERPRET: tl.constexpr):
    """One semantic key block of the online softmax (mok/reference/attention.py), in fp32.

    The row sum of p is a tensor-core dot with ones, like the p @ v it normalises: a reduction with
    tl.sum would follow the register layout, which changes with the tile shape and the warp count."""
    s_MN = _scaled(tl.dot(q_MD, k_DN, input_precision="ieee"), scale, INTERPRET)
    if MASKED:
        s_MN = tl.where(keep_MN, s_MN, float("-inf"))
    max_new_M = tl.maximum(max_M, tl.max(s_MN, 1))
    alpha_M = tl.exp(max_M - max_new_M)
    p_MN = tl.exp(s_MN - max_new_M[:, None]).to(v_ND.dtype)
    ones_N16 = tl.full((v_ND.shape[0], 16), 1.0, v_ND.dtype)
    sum_M = sum_M * alpha_M + tl.max(tl.dot(p_MN, ones_N16, input_precision="ieee"), 1)
    acc_MD = acc_MD * alpha_M[:, None]
    acc_MD = tl.dot(p_MN, v_ND, acc_MD, input_precision="ieee")
    return acc_MD, max_new_M, sum_M


@cached_launch
@triton.jit
def _attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, k_desc, v_desc, out_ptr, lse_ptr, cu_q_ptr, keys_ptr, block_table_ptr,
    num_seqs, scale,
    stride_qt, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_lt, stride_table,
    GROUP: tl.constexpr, PACK: tl.constexpr, CAUSAL: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr,
    USE_TMA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    KEY_BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
):
    # keys_ptr: cu_seqlens_k [B + 1] (packed keys) or seq_lens_k [B] (paged keys)
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
    q_MD = tl.load(q_ptr + (q_start + query_M)[:, None] * stride_qt + head_M[:, None] * stride_qh + d_D[None, :],
                   mask=row_ok_M[:, None] & d_ok_D[None, :], other=0.0)

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
    acc_MD = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    n_base = tl.arange(0, KEY_BLOCK).to(tl.int64)
    # blocks every row of the tile sees in full: no mask
    for start_n in range(0, full_end, KEY_BLOCK):
        if USE_TMA:
            k_ND = k_desc.load([(key_start + start_n).to(tl.int32), (kv_head * HEAD_DIM).to(tl.int32)])
            v_ND = v_desc.load([(key_start + start_n).to(tl.int32), (kv_head * HEAD_DIM).to(tl.int32)])
            k_DN = tl.trans(k_ND)
        else:
            page_N, slot_N = _key_slots(start_n + n_base, key_start, seq, block_table_ptr, stride_table, PAGED, PAGE)
            k_DN = tl.load(k_ptr + (page_N * stride_kp + slot_N * stride_kt)[None, :] + kv_head * stride_kh
                           + d_D[:, None], mask=d_ok_D[:, None], other=0.0)
            v_ND = tl.load(v_ptr + (page_N * stride_vp + slot_N * stride_vt)[:, None] + kv_head * stride_vh
                           + d_D[None, :], mask=d_ok_D[None, :], other=0.0)
        acc_MD, max_M, sum_M = _softmax_block(q_MD, k_DN, v_ND, acc_MD, max_M, sum_M, scale, None, False,
                                                    INTERPRET)
    # the diagonal: masked per row (pointer loads, so no key of another sequence is ever read)
    for start_n in range(full_end, key_end, KEY_BLOCK):
        n_N = start_n + n_base
        key_ok_N = n_N < len_k
        page_N, slot_N = _key_slots(tl.where(key_ok_N, n_N, 0), key_start, seq, block_table_ptr, stride_table,
                                    PAGED, PAGE)
        k_DN = tl.load(k_ptr + (page_N * stride_kp + slot_N * stride_kt)[None, :] + kv_head * stride_kh
                       + d_D[:, None], mask=key_ok_N[None, :] & d_ok_D[:, None], other=0.0)
        v_ND = tl.load(v_ptr + (page_N * stride_vp + slot_N * stride_vt)[:, None] + kv_head * stride_vh
                       + d_D[None, :], mask=key_ok_N[:, None] & d_ok_D[None, :], other=0.0)
        keep_MN = (n_N[None, :] < visible_M[:, None]) & key_ok_N[None, :]
        acc_MD, max_M, sum_M = _softmax_block(q_MD, k_DN, v_ND, acc_MD, max_M, sum_M, scale, keep_MN, True,
                                                    INTERPRET)

    out_MD = acc_MD / sum_M[:, None]
    tl.store(out_ptr + (q_start + query_M)[:, None] * stride_ot + head_M[:, None] * stride_oh + d_D[None, :],
             out_MD.to(out_ptr.dtype.element_ty), mask=row_ok_M[:, None] & d_ok_D[None, :])
    tl.store(lse_ptr + (q_start + query_M) * stride_lt + head_M, max_M + tl.log(sum_M), mask=row_ok_M)


@cached_launch
@triton.jit
def _attention_bwd_delta_kernel(out_ptr, grad_ptr, delta_ptr, num_rows, stride_o, stride_g,
                                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """delta [T * Q] = rowsum(out * grad) in fp32, over rows of the [T * Q, D] views."""
    r_R = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    d_D = tl.arange(0, BLOCK_D)
    mask = (r_R < num_rows)[:, None] & (d_D < HEAD_DIM)[None, :]
    o_RD = tl.load(out_ptr + r_R[:, None] * stride_o + d_D[None, :], mask=mask, other=0.0).to(tl.float32)
    g_RD = tl.load(grad_ptr + r_R[:, None] * stride_g + d_D[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(delta_ptr + r_R, tl.sum(o_RD * g_RD, 1), mask=r_R < num_rows)


@triton.jit
def _dkdv_tile(q_ptr, grad_ptr, q_desc, g_desc, lse_ptr, delta_ptr, k_ND, v_ND, dk_ND, dv_ND, q_start, start_m, len_q,
               head, offset, n_N, m_base, d_D, d_ok_D, qk_scale_log2, stride_qt, stride_qh, stride_gt, stride_gh,
               stride_lt, MASKED: tl.constexpr, CAUSAL: tl.constexpr, USE_TMA: tl.constexpr,
               HEAD_DIM: tl.constexpr):
    """dK, dV of one key tile += the contributions of one query tile, computed transposed ([keys, queries])
    so that no register tile needs a transpose. Unmasked tiles hold only rows of the sequence that see every
    key of the tile; masked ones may run past the sequence or cross the causal diagonal."""
    i_M = start_m + m_base
    rows_M = q_start + i_M
    if MASKED:
        row_ok_M = i_M < len_q
        q_MD = tl.load(q_ptr + rows_M[:, None] * stride_qt + head * stride_qh + d_D[None, :],
                       mask=row_ok_M[:, None] & d_ok_D[None, :], other=0.0)
        do_MD = tl.load(grad_ptr + rows_M[:, None] * stride_gt + head * stride_gh + d_D[None, :],
                        mask=row_ok_M[:, None] & d_ok_D[None, :], other=0.0)
        lse_M = tl.load(lse_ptr + rows_M * stride_lt + head, mask=row_ok_M, other=0.0)
        delta_M = tl.load(delta_ptr + rows_M * stride_lt + head, mask=row_ok_M, other=0.0)
    else:
        if USE_TMA:
            q_MD = q_desc.load([(q_start + start_m).to(tl.int32), (head * HEAD_DIM).to(tl.int32)])
            do_MD = g_desc.load([(q_start + start_m).to(tl.int32), (head * HEAD_DIM).to(tl.int32)])
        else:
            q_MD = tl.load(q_ptr + rows_M[:, None] * stride_qt + head * stride_qh + d_D[None, :],
                           mask=d_ok_D[None, :], other=0.0)
            do_MD = tl.load(grad_ptr + rows_M[:, None] * stride_gt + head * stride_gh + d_D[None, :],
                            mask=d_ok_D[None, :], other=0.0)
        lse_M = tl.load(lse_ptr + rows_M * stride_lt + head)
        delta_M = tl.load(delta_ptr + rows_M * stride_lt + head)
    p_NM = tl.exp2(tl.dot(k_ND, tl.trans(q_MD), input_precision="ieee") * qk_scale_log2
                   - (lse_M * LOG2E)[None, :])
    if MASKED:
        keep_NM = row_ok_M[None, :]
        if CAUSAL:
            keep_NM = keep_NM & (n_N[:, None] <= offset + i_M[None, :])
        p_NM = tl.where(keep_NM, p_NM, 0.0)
    dv_ND = tl.dot(p_NM.to(do_MD.dtype), do_MD, dv_ND, input_precision="ieee")
    dp_NM = tl.dot(v_ND, tl.trans(do_MD), input_precision="ieee")
    ds_NM = p_NM * (dp_NM - delta_M[None, :])
    dk_ND = tl.dot(ds_NM.to(q_MD.dtype), q_MD, dk_ND, input_precision="ieee")
    return dk_ND, dv_ND


@cached_launch
@triton.jit
def _attention_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, grad_ptr, q_desc, g_desc, lse_ptr, delta_ptr, dk_ptr, dv_ptr, cu_q_ptr, cu_k_ptr, num_seqs,
    scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh, stride_lt,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr,
):
    seq, tile, key_start, len_k = _tile_of_program(cu_k_ptr, tl.program_id(0), num_seqs, BLOCK_N)
    if tile * BLOCK_N >= len_k:
        return
    kv_head = tl.program_id(1)
    q_start = tl.load(cu_q_ptr + seq).to(tl.int64)
    len_q = tl.load(cu_q_ptr + seq + 1).to(tl.int64) - q_start
    offset = len_k - len_q  # query i sits at key position offset + i
    n_N = tile * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    key_ok_N = n_N < len_k
    d_D = tl.arange(0, BLOCK_D)
    d_ok_D = d_D < HEAD_DIM
    kv_mask = key_ok_N[:, None] & d_ok_D[None, :]
    k_ND = tl.load(k_ptr + (key_start + n_N)[:, None] * stride_kt + kv_head * stride_kh + d_D[None, :],
                   mask=kv_mask, other=0.0)
    v_ND = tl.load(v_ptr + (key_start + n_N)[:, None] * stride_vt + kv_head * stride_vh + d_D[None, :],
                   mask=kv_mask, other=0.0)
    dk_ND = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv_ND = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    if CAUSAL:
        # query tiles that see only part of this key tile (the diagonal), then those that see all of it
        first_query = tl.maximum(tile * BLOCK_N - offset, 0) // BLOCK_M * BLOCK_M
        full_query = tl.minimum(tl.cdiv(tl.maximum(tile * BLOCK_N + BLOCK_N - 1 - offset, 0), BLOCK_M) * BLOCK_M,
                                len_q)
    else:
        first_query = 0
        full_query = 0
    last_full = full_query + (len_q - full_query) // BLOCK_M * BLOCK_M  # then one tile past the sequence's end
    qk_scale_log2 = scale * LOG2E
    m_base = tl.arange(0, BLOCK_M).to(tl.int64)
    for g in range(GROUP):
        head = kv_head * GROUP + g
        for start_m in range(first_query, full_query, BLOCK_M):
            dk_ND, dv_ND = _dkdv_tile(q_ptr, grad_ptr, q_desc, g_desc, lse_ptr, delta_ptr, k_ND, v_ND, dk_ND, dv_ND,
                                      q_start, start_m, len_q, head, offset, n_N, m_base, d_D, d_ok_D, qk_scale_log2,
                                      stride_qt, stride_qh, stride_gt, stride_gh, stride_lt, True, CAUSAL, USE_TMA,
                                      HEAD_DIM)
        for start_m in range(full_query, last_full, BLOCK_M):
            dk_ND, dv_ND = _dkdv_tile(q_ptr, grad_ptr, q_desc, g_desc, lse_ptr, delta_ptr, k_ND, v_ND, dk_ND, dv_ND,
                                      q_start, start_m, len_q, head, offset, n_N, m_base, d_D, d_ok_D, qk_scale_log2,
                                      stride_qt, stride_qh, stride_gt, stride_gh, stride_lt, False, CAUSAL, USE_TMA,
                                      HEAD_DIM)
        for start_m in range(last_full, len_q, BLOCK_M):
            dk_ND, dv_ND = _dkdv_tile(q_ptr, grad_ptr, q_desc, g_desc, lse_ptr, delta_ptr, k_ND, v_ND, dk_ND, dv_ND,
                                      q_start, start_m, len_q, head, offset, n_N, m_base, d_D, d_ok_D, qk_scale_log2,
                                      stride_qt, stride_qh, stride_gt, stride_gh, stride_lt, True, CAUSAL, USE_TMA,
                                      HEAD_DIM)
    tl.store(dk_ptr + (key_start + n_N)[:, None] * stride_dkt + kv_head * stride_dkh + d_D[None, :],
             (dk_ND * scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + (key_start + n_N)[:, None] * stride_dvt + kv_head * stride_dvh + d_D[None, :],
             dv_ND.to(dv_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_tile(k_ptr, v_ptr, k_desc, v_desc, q_MD, do_MD, lse2_M, delta_M, dq_MD, key_start, start_n, len_k, kv_head,
             offset, i_M, row_ok_M, n_base, d_D, d_ok_D, qk_scale_log2, stride_kt, stride_kh, stride_vt, stride_vh,
             MASKED: tl.constexpr, CAUSAL: tl.constexpr, USE_TMA: tl.constexpr, HEAD_DIM: tl.constexpr):
    """dQ of one query tile += the contributions of one key tile. Unmasked tiles hold only keys every row of
    the query tile sees."""
    n_N = start_n + n_base
    if MASKED:
        key_ok_N = n_N < len_k
        kv_mask = key_ok_N[:, None] & d_ok_D[None, :]
        k_ND = tl.load(k_ptr + (key_start + n_N)[:, None] * stride_kt + kv_head * stride_kh + d_D[None, :],
                       mask=kv_mask, other=0.0)
        v_ND = tl.load(v_ptr + (key_start + n_N)[:, None] * stride_vt + kv_head * stride_vh + d_D[None, :],
                       mask=kv_mask, other=0.0)
    elif USE_TMA:
        k_ND = k_desc.load([(key_start + start_n).to(tl.int32), (kv_head * HEAD_DIM).to(tl.int32)])
        v_ND = v_desc.load([(key_start + start_n).to(tl.int32), (kv_head * HEAD_DIM).to(tl.int32)])
    else:
        k_ND = tl.load(k_ptr + (key_start + n_N)[:, None] * stride_kt + kv_head * stride_kh + d_D[None, :],
                       mask=d_ok_D[None, :], other=0.0)
        v_ND = tl.load(v_ptr + (key_start + n_N)[:, None] * stride_vt + kv_head * stride_vh + d_D[None, :],
                       mask=d_ok_D[None, :], other=0.0)
    p_MN = tl.exp2(tl.dot(q_MD, tl.trans(k_ND), input_precision="ieee") * qk_scale_log2 - lse2_M[:, None])
    if MASKED:
        keep_MN = row_ok_M[:, None] & key_ok_N[None, :]
        if CAUSAL:
            keep_MN = keep_MN & (n_N[None, :] <= offset + i_M[:, None])
        p_MN = tl.where(keep_MN, p_MN, 0.0)
    dp_MN = tl.dot(do_MD, tl.trans(v_ND), input_precision="ieee")
    ds_MN = p_MN * (dp_MN - delta_M[:, None])
    return tl.dot(ds_MN.to(k_ND.dtype), k_ND, dq_MD, input_precision="ieee")


@cached_launch
@triton.jit
def _attention_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, grad_ptr, k_desc, v_desc, lse_ptr, delta_ptr, dq_ptr, cu_q_ptr, cu_k_ptr, num_seqs, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh, stride_lt,
    stride_dqt, stride_dqh,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr,
):
    seq, tile, q_start, len_q = _tile_of_program(cu_q_ptr, tl.program_id(0), num_seqs, BLOCK_M)
    num_tiles = tl.cdiv(len_q, BLOCK_M)
    if tile >= num_tiles:
        return
    q_tile = num_tiles - 1 - tile
    head = tl.program_id(1)
    kv_head = head // GROUP
    key_start = tl.load(cu_k_ptr + seq).to(tl.int64)
    len_k = tl.load(cu_k_ptr + seq + 1).to(tl.int64) - key_start
    offset = len_k - len_q
    i_M = q_tile * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    row_ok_M = i_M < len_q
    d_D = tl.arange(0, BLOCK_D)
    d_ok_D = d_D < HEAD_DIM
    row_mask = row_ok_M[:, None] & d_ok_D[None, :]
    q_MD = tl.load(q_ptr + (q_start + i_M)[:, None] * stride_qt + head * stride_qh + d_D[None, :],
                   mask=row_mask, other=0.0)
    do_MD = tl.load(grad_ptr + (q_start + i_M)[:, None] * stride_gt + head * stride_gh + d_D[None, :],
                    mask=row_mask, other=0.0)
    lse2_M = tl.load(lse_ptr + (q_start + i_M) * stride_lt + head, mask=row_ok_M, other=0.0) * LOG2E
    delta_M = tl.load(delta_ptr + (q_start + i_M) * stride_lt + head, mask=row_ok_M, other=0.0)
    if CAUSAL:
        full_end = (offset + q_tile * BLOCK_M + 1) // BLOCK_N * BLOCK_N  # keys every row of the tile sees
        key_end = tl.minimum(len_k, offset + tl.minimum((q_tile + 1) * BLOCK_M, len_q))
    else:
        full_end = len_k // BLOCK_N * BLOCK_N
        key_end = len_k
    qk_scale_log2 = scale * LOG2E
    dq_MD = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    n_base = tl.arange(0, BLOCK_N).to(tl.int64)
    for start_n in range(0, full_end, BLOCK_N):
        dq_MD = _dq_tile(k_ptr, v_ptr, k_desc, v_desc, q_MD, do_MD, lse2_M, delta_M, dq_MD, key_start, start_n, len_k,
                         kv_head, offset, i_M, row_ok_M, n_base, d_D, d_ok_D, qk_scale_log2, stride_kt, stride_kh,
                         stride_vt, stride_vh, False, CAUSAL, USE_TMA, HEAD_DIM)
    for start_n in range(full_end, key_end, BLOCK_N):
        dq_MD = _dq_tile(k_ptr, v_ptr, k_desc, v_desc, q_MD, do_MD, lse2_M, delta_M, dq_MD, key_start, start_n, len_k,
                         kv_head, offset, i_M, row_ok_M, n_base, d_D, d_ok_D, qk_scale_log2, stride_kt, stride_kh,
                         stride_vt, stride_vh, True, CAUSAL, USE_TMA, HEAD_DIM)
    tl.store(dq_ptr + (q_start + i_M)[:, None] * stride_dqt + head * stride_dqh + d_D[None, :],
             (dq_MD * scale).to(dq_ptr.dtype.element_ty), mask=row_mask)


@cached_launch
@triton.jit
def _write_kv_cache_kernel(k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, slot_ptr, stride_kt, stride_kg, stride_vt,
                           stride_vg, stride_cp, stride_cz, stride_cg, stride_vcp, stride_vcz, stride_vcg,
                           NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                           BLOCK_D: tl.constexpr, PAGE: tl.constexpr):
    """One program per token: its K and V rows into its cache slot; a negative slot (padding) writes nothing."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    page = slot // PAGE
    offset = slot % PAGE
    g_G = tl.arange(0, BLOCK_G)
    d_D = tl.arange(0, BLOCK_D)
    mask = (g_G < NUM_KV_HEADS)[:, None] & (d_D < HEAD_DIM)[None, :]
    k_GD = tl.load(k_ptr + token * stride_kt + g_G[:, None] * stride_kg + d_D[None, :], mask=mask)
    v_GD = tl.load(v_ptr + token * stride_vt + g_G[:, None] * stride_vg + d_D[None, :], mask=mask)
    tl.store(key_cache_ptr + page * stride_cp + offset * stride_cz + g_G[:, None] * stride_cg + d_D[None, :],
             k_GD.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + page * stride_vcp + offset * stride_vcz + g_G[:, None] * stride_vcg + d_D[None, :],
             v_GD.to(value_cache_ptr.dtype.element_ty), mask=mask)


# ============================================================================================
# configs and launchers
# ============================================================================================

# One place for every launch configuration: chosen from the head dim and the path, never from the
# token count. BLOCK_M and PACK change only which rows share a tile (not their bits: the GPU test
# re-proves it); KEY_BLOCK is the semantic block and comes from mok.reference.attention.
CONFIGS = {
    "forward": dict(BLOCK_M=128, PACK=1, num_warps=8, num_stages=3),
    "forward_small_d": dict(BLOCK_M=128, PACK=1, num_warps=4, num_stages=3),
    "decode": dict(BLOCK_M=16, num_warps=4, num_stages=2),  # PACK = the GQA group (at most BLOCK_M)
    # backward: measured on the H200 (bench/attention_sweep.py; every candidate gave today's bits there,
    # though only determinism is promised). TMA=1: descriptor loads of the tiles every row sees (q and
    # d out for dK/dV, k and v for dQ) where the layout allows (`_rows_descriptor`)
    "backward_dkdv": dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=2, TMA=1),
    "backward_dq": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, TMA=1),
    "backward_delta": dict(BLOCK_R=64, num_warps=4),
}


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _forward_config(head_dim: int, group: int, decode: bool) -> dict:
    if decode:
        config = dict(CONFIGS["decode"])
        pack = 1
        while group % (pack * 2) == 0 and pack * 2 <= config["BLOCK_M"]:
            pack *= 2  # the largest power of two dividing the group: whole tiles of one group
        config["PACK"] = pack
        return config
    return dict(CONFIGS["forward" if head_dim > 64 else "forward_small_d"])


def _rows_descriptor(t_TXD: torch.Tensor, block_rows: int):
    """A TMA descriptor over t_TXD [T, X, D] seen as [T, X * D] with [block_rows, D] boxes, or None where TMA
    cannot read it: it needs 16-bit data, D a power of two with its X heads side by side (any row stride) and
    16-byte alignment."""
    num_rows, num_heads, head_dim = t_TXD.shape
    if (TensorDescriptor is None or t_TXD.dtype not in (torch.bfloat16, torch.float16) or t_TXD.numel() == 0
            or t_TXD.stride(2) != 1 or (num_heads > 1 and t_TXD.stride(1) != head_dim)
            or head_dim != _block_d(head_dim) or t_TXD.data_ptr() % 16
            or t_TXD.stride(0) * t_TXD.element_size() % 16):
        return None
    return TensorDescriptor(t_TXD, [num_rows, num_heads * head_dim], [t_TXD.stride(0), 1], [block_rows, head_dim])


def _descriptors(use_tma: bool, tensors: tuple[torch.Tensor, ...], block_rows: int) -> tuple:
    """Descriptors for every tensor when TMA is asked for and all of them allow it, else the tensors
    themselves (the kernels' pointer loads)."""
    descriptors = [_rows_descriptor(t, block_rows) for t in tensors] if use_tma else [None]
    return tuple(descriptors) if None not in descriptors else tensors


def attention_forward(q_TQD: torch.Tensor, k_SGD: torch.Tensor, v_SGD: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, scale: float, causal: bool, *, use_tma: bool = True,
                      config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed keys. q_TQD [T, Q, D], k_SGD / v_SGD [S, G, D] (D contiguous), cu_seqlens_q / _k int32
    [B + 1] on the device. -> (out [T, Q, D] in q's dtype, lse fp32 [T, Q]). No host synchronisation."""
    return _launch_forward(q_TQD, k_SGD, v_SGD, cu_seqlens_q, cu_seqlens_k, None, scale, causal, use_tma, config)


def paged_attention_forward(q_TQD: torch.Tensor, key_cache_PZGD: torch.Tensor, value_cache_PZGD: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor, block_table_BP: torch.Tensor,
                            scale: float, *, decode: bool = False, config: dict | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys in a paged cache. key_cache_PZGD / value_cache_PZGD [P, Z, G, D] (any page, slot and head strides,
    D contiguous: read in place, e.g. vLLM's caches that interleave keys and values); seq_lens_k int32 [B]
    keys per sequence (its queries are its last keys); block_table_BP int32 [B, pages per sequence].
    Causal. decode=True packs a GQA group's heads into one tile (for one or a few queries per sequence).
    -> (out [T, Q, D], lse fp32 [T, Q])."""
    head_dim = key_cache_PZGD.shape[3]
    if config is None:
        config = _forward_config(head_dim, q_TQD.shape[1] // key_cache_PZGD.shape[2], decode)
    return _launch_forward(q_TQD, key_cache_PZGD, value_cache_PZGD, cu_seqlens_q, seq_lens_k, block_table_BP,
                           scale, True, False, config)


def _launch_forward(q_TQD, k_xGD, v_xGD, cu_seqlens_q, keys, block_table_BP, scale, causal, use_tma, config):
    """k_xGD / v_xGD: packed keys [S, G, D] (block_table_BP None) or a paged cache [P, Z, G, D]."""
    num_tokens, num_q_heads, head_dim = q_TQD.shape
    paged = block_table_BP is not None
    num_kv_heads = k_xGD.shape[-2]
    group = num_q_heads // num_kv_heads
    out_TQD = torch.empty_like(q_TQD)
    lse_TQ = torch.empty(num_tokens, num_q_heads, dtype=torch.float32, device=q_TQD.device)
    num_seqs = cu_seqlens_q.numel() - 1
    if num_tokens == 0 or num_seqs == 0:
        return out_TQD, lse_TQ
    config = dict(config or _forward_config(head_dim, group, False))
    pack = config.pop("PACK")
    block_m = config["BLOCK_M"]
    key_block = key_block_size(head_dim)
    k_arg, v_arg = _descriptors(use_tma and not paged, (k_xGD, v_xGD), key_block)
    tma = k_arg is not k_xGD
    # (page, slot, head) strides; packed keys are one page whose slots are the key rows
    k_strides = k_xGD.stride()[:3] if paged else (0, *k_xGD.stride()[:2])
    v_strides = v_xGD.stride()[:3] if paged else (0, *v_xGD.stride()[:2])
    page_size = k_xGD.shape[1] if paged else 1
    grid = (num_tokens // (block_m // pack) + num_seqs, num_q_heads // pack)
    _attention_fwd_kernel[grid](
        q_TQD, k_xGD, v_xGD, k_arg, v_arg, out_TQD, lse_TQ, cu_seqlens_q, keys,
        block_table_BP if paged else cu_seqlens_q, num_seqs, scale,
        q_TQD.stride(0), q_TQD.stride(1), *k_strides, *v_strides,
        out_TQD.stride(0), out_TQD.stride(1), lse_TQ.stride(0), block_table_BP.stride(0) if paged else 0,
        GROUP=group, PACK=pack, CAUSAL=causal, PAGED=paged, PAGE=page_size, USE_TMA=tma, HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim), KEY_BLOCK=key_block, INTERPRET=INTERPRET, **config,
    )
    return out_TQD, lse_TQ


def attention_backward(grad_TQD: torch.Tensor, q_TQD: torch.Tensor, k_SGD: torch.Tensor, v_SGD: torch.Tensor,
                       out_TQD: torch.Tensor, lse_TQ: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       cu_seqlens_k: torch.Tensor, scale: float, causal: bool, *, configs: dict | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dq [T, Q, D], dk [S, G, D], dv [S, G, D]) in the inputs' dtypes. Deterministic; every key
    row of k_SGD outside the sequences gets a zero gradient. q, k and v may be strided views (D contiguous);
    grad and out are read as [T * Q, D] rows (copied first when not laid out so). `configs` overrides
    entries of CONFIGS (a backward entry without TMA loads through pointers)."""
    grad_TQD, out_TQD = grad_TQD.contiguous(), out_TQD.contiguous()
    num_tokens, num_q_heads, head_dim = q_TQD.shape
    num_keys, num_kv_heads, _ = k_SGD.shape
    num_seqs = cu_seqlens_q.numel() - 1
    dq_TQD = torch.empty_like(q_TQD)
    dk_SGD = torch.zeros_like(k_SGD)
    dv_SGD = torch.zeros_like(v_SGD)
    if num_tokens == 0 or num_seqs == 0:
        return dq_TQD, dk_SGD, dv_SGD
    block_d = _block_d(head_dim)
    delta_TQ = torch.empty(num_tokens, num_q_heads, dtype=torch.float32, device=q_TQD.device)
    config = dict(CONFIGS["backward_delta"])
    rows = num_tokens * num_q_heads
    _attention_bwd_delta_kernel[(triton.cdiv(rows, config["BLOCK_R"]),)](
        out_TQD.view(rows, head_dim), grad_TQD.view(rows, head_dim), delta_TQ, rows, head_dim, head_dim,
        HEAD_DIM=head_dim, BLOCK_D=block_d, **config)
    common = dict(GROUP=num_q_heads // num_kv_heads, CAUSAL=causal, HEAD_DIM=head_dim, BLOCK_D=block_d)
    strides = (q_TQD.stride(0), q_TQD.stride(1), k_SGD.stride(0), k_SGD.stride(1), v_SGD.stride(0), v_SGD.stride(1),
               grad_TQD.stride(0), grad_TQD.stride(1), lse_TQ.stride(0))
    configs = {**CONFIGS, **(configs or {})}
    config = dict(configs["backward_dkdv"])
    q_arg, g_arg = _descriptors(config.pop("TMA", 0), (q_TQD, grad_TQD), config["BLOCK_M"])
    _attention_bwd_dkdv_kernel[(num_keys // config["BLOCK_N"] + num_seqs, num_kv_heads)](
        q_TQD, k_SGD, v_SGD, grad_TQD, q_arg, g_arg, lse_TQ, delta_TQ, dk_SGD, dv_SGD, cu_seqlens_q, cu_seqlens_k,
        num_seqs, scale, *strides, dk_SGD.stride(0), dk_SGD.stride(1), dv_SGD.stride(0), dv_SGD.stride(1), **common,
        USE_TMA=q_arg is not q_TQD, **config)
    config = dict(configs["backward_dq"])
    k_arg, v_arg = _descriptors(config.pop("TMA", 0), (k_SGD, v_SGD), config["BLOCK_N"])
    _attention_bwd_dq_kernel[(num_tokens // config["BLOCK_M"] + num_seqs, num_q_heads)](
        q_TQD, k_SGD, v_SGD, grad_TQD, k_arg, v_arg, lse_TQ, delta_TQ, dq_TQD, cu_seqlens_q, cu_seqlens_k, num_seqs,
        scale, *strides, dq_TQD.stride(0), dq_TQD.stride(1), **common, USE_TMA=k_arg is not k_SGD, **config)
    return dq_TQD, dk_SGD, dv_SGD


def write_kv_cache(k_TGD: torch.Tensor, v_TGD: torch.Tensor, key_cache_PZGD: torch.Tensor,
                   value_cache_PZGD: torch.Tensor, slot_mapping_T: torch.Tensor) -> None:
    """key_cache[slot // Z, slot % Z] = k, value_cache likewise, for every token with slot >= 0 (in place;
    D contiguous everywhere). No host synchronisation, so it can be captured in a CUDA graph."""
    num_tokens, num_kv_heads, head_dim = k_TGD.shape
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        k_TGD, v_TGD, key_cache_PZGD, value_cache_PZGD, slot_mapping_T, k_TGD.stride(0), k_TGD.stride(1),
        v_TGD.stride(0), v_TGD.stride(1), key_cache_PZGD.stride(0), key_cache_PZGD.stride(1),
        key_cache_PZGD.stride(2), value_cache_PZGD.stride(0), value_cache_PZGD.stride(1), value_cache_PZGD.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_G=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=_block_d(head_dim), PAGE=key_cache_PZGD.shape[1], num_warps=1)
