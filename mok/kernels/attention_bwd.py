"""The Triton kernels of the attention backward (delta, dK/dV, dQ; deterministic, no atomics). Design and
launchers: mok/kernels/attention.py.

Shapes: docs/shapes.md. Semantics and rounding points: mok/reference/attention.py.
"""
from __future__ import annotations

import triton
import triton.language as tl

from mok.kernels.attention_fwd import _scores, _tile_of_program
from mok.kernels.launch import cached_launch

LOG2E = tl.constexpr(1.4426950408889634)  # the backward's exponentials are exp2 of log2-scaled scores


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
def _dkdv_tile(q_ptr, grad_ptr, q_desc, g_desc, lse_ptr, delta_ptr, k_ND, k_NT, v_NW, dk_ND, dk_NT, dv_NW, q_start,
               start_m, len_q, head, offset, n_N, m_base, d_D, d_ok_D, t_T, t_ok_T, w_W, w_ok_W, qk_scale_log2,
               stride_qt, stride_qh, stride_gt, stride_gh, stride_lt, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
               USE_TMA: tl.constexpr, HEAD_DIM: tl.constexpr, TAIL: tl.constexpr):
    """dK, dV of one key tile += the contributions of one query tile, computed transposed ([keys, queries])
    so that no register tile needs a transpose. Unmasked tiles hold only rows of the sequence that see every
    key of the tile; masked ones may run past the sequence or cross the causal diagonal. TAIL: the head's
    features past BLOCK_D (k_NT, dk_NT; mok/kernels/attention.py split_head)."""
    i_M = start_m + m_base
    rows_M = q_start + i_M
    q_rows_M = rows_M * stride_qt + head * stride_qh
    g_rows_M = rows_M * stride_gt + head * stride_gh
    if MASKED:
        row_ok_M = i_M < len_q
        q_MD = tl.load(q_ptr + q_rows_M[:, None] + d_D[None, :], mask=row_ok_M[:, None] & d_ok_D[None, :], other=0.0)
        do_MW = tl.load(grad_ptr + g_rows_M[:, None] + w_W[None, :], mask=row_ok_M[:, None] & w_ok_W[None, :],
                        other=0.0)
        lse_M = tl.load(lse_ptr + rows_M * stride_lt + head, mask=row_ok_M, other=0.0)
        delta_M = tl.load(delta_ptr + rows_M * stride_lt + head, mask=row_ok_M, other=0.0)
    else:
        row_ok_M = i_M >= 0
        if USE_TMA:  # (no tail, VALUE_DIM == HEAD_DIM: the launcher's condition)
            q_MD = q_desc.load([(q_start + start_m).to(tl.int32), (head * HEAD_DIM).to(tl.int32)])
            do_MW = g_desc.load([(q_start + start_m).to(tl.int32), (head * HEAD_DIM).to(tl.int32)])
        else:
            q_MD = tl.load(q_ptr + q_rows_M[:, None] + d_D[None, :], mask=d_ok_D[None, :], other=0.0)
            do_MW = tl.load(grad_ptr + g_rows_M[:, None] + w_W[None, :], mask=w_ok_W[None, :], other=0.0)
        lse_M = tl.load(lse_ptr + rows_M * stride_lt + head)
        delta_M = tl.load(delta_ptr + rows_M * stride_lt + head)
    if TAIL:
        q_MT = tl.load(q_ptr + q_rows_M[:, None] + t_T[None, :], mask=row_ok_M[:, None] & t_ok_T[None, :], other=0.0)
    else:
        q_MT = q_MD  # (unused)
    p_NM = tl.exp2(_scores(k_ND, tl.trans(q_MD), k_NT, tl.trans(q_MT), TAIL) * qk_scale_log2
                   - (lse_M * LOG2E)[None, :])
    if MASKED:
        keep_NM = row_ok_M[None, :]
        if CAUSAL:
            keep_NM = keep_NM & (n_N[:, None] <= offset + i_M[None, :])
        p_NM = tl.where(keep_NM, p_NM, 0.0)
    dv_NW = tl.dot(p_NM.to(do_MW.dtype), do_MW, dv_NW, input_precision="ieee")
    dp_NM = tl.dot(v_NW, tl.trans(do_MW), input_precision="ieee")
    ds_NM = (p_NM * (dp_NM - delta_M[None, :])).to(q_MD.dtype)
    dk_ND = tl.dot(ds_NM, q_MD, dk_ND, input_precision="ieee")
    if TAIL:
        dk_NT = tl.dot(ds_NM, q_MT, dk_NT, input_precision="ieee")
    return dk_ND, dk_NT, dv_NW


@cached_launch
@triton.jit
def _attention_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, grad_ptr, q_desc, g_desc, lse_ptr, delta_ptr, dk_ptr, dv_ptr, cu_q_ptr, cu_k_ptr, num_seqs,
    scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh, stride_lt,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TAIL: tl.constexpr,
    BLOCK_T: tl.constexpr, VALUE_DIM: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr,
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
    t_T = BLOCK_D + tl.arange(0, BLOCK_T)
    t_ok_T = t_T < HEAD_DIM
    w_W = tl.arange(0, BLOCK_W)
    w_ok_W = w_W < VALUE_DIM
    k_keys_N = (key_start + n_N) * stride_kt + kv_head * stride_kh
    k_mask = key_ok_N[:, None] & d_ok_D[None, :]
    k_ND = tl.load(k_ptr + k_keys_N[:, None] + d_D[None, :], mask=k_mask, other=0.0)
    v_mask = key_ok_N[:, None] & w_ok_W[None, :]
    v_NW = tl.load(v_ptr + (key_start + n_N)[:, None] * stride_vt + kv_head * stride_vh + w_W[None, :],
                   mask=v_mask, other=0.0)
    dk_ND = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv_NW = tl.zeros((BLOCK_N, BLOCK_W), tl.float32)
    t_mask = key_ok_N[:, None] & t_ok_T[None, :]
    if TAIL:
        k_NT = tl.load(k_ptr + k_keys_N[:, None] + t_T[None, :], mask=t_mask, other=0.0)
        dk_NT = tl.zeros((BLOCK_N, BLOCK_T), tl.float32)
    else:  # (unused; a small loop-carried placeholder, never a second accumulator's registers)
        k_NT = k_ND
        dk_NT = tl.zeros((16, 16), tl.float32)
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
            dk_ND, dk_NT, dv_NW = _dkdv_tile(
                q_ptr, grad_ptr, q_desc, g_desc, lse_ptr, delta_ptr, k_ND, k_NT, v_NW, dk_ND, dk_NT, dv_NW, q_start,
                start_m, len_q, head, offset, n_N, m_base, d_D, d_ok_D, t_T, t_ok_T, w_W, w_ok_W, qk_scale_log2,
                stride_qt, stride_qh, stride_gt, stride_gh, stride_lt, True, CAUSAL, USE_TMA, HEAD_DIM, TAIL)
        for start_m in range(full_query, last_full, BLOCK_M):
            dk_ND, dk_NT, dv_NW = _dkdv_tile(
                q_ptr, grad_ptr, q_desc, g_desc, lse_ptr, delta_ptr, k_ND, k_NT, v_NW, dk_ND, dk_NT, dv_NW, q_start,
                start_m, len_q, head, offset, n_N, m_base, d_D, d_ok_D, t_T, t_ok_T, w_W, w_ok_W, qk_scale_log2,
                stride_qt, stride_qh, stride_gt, stride_gh, stride_lt, False, CAUSAL, USE_TMA, HEAD_DIM, TAIL)
        for start_m in range(last_full, len_q, BLOCK_M):
            dk_ND, dk_NT, dv_NW = _dkdv_tile(
                q_ptr, grad_ptr, q_desc, g_desc, lse_ptr, delta_ptr, k_ND, k_NT, v_NW, dk_ND, dk_NT, dv_NW, q_start,
                start_m, len_q, head, offset, n_N, m_base, d_D, d_ok_D, t_T, t_ok_T, w_W, w_ok_W, qk_scale_log2,
                stride_qt, stride_qh, stride_gt, stride_gh, stride_lt, True, CAUSAL, USE_TMA, HEAD_DIM, TAIL)
    dk_keys_N = (key_start + n_N) * stride_dkt + kv_head * stride_dkh
    tl.store(dk_ptr + dk_keys_N[:, None] + d_D[None, :], (dk_ND * scale).to(dk_ptr.dtype.element_ty), mask=k_mask)
    if TAIL:
        tl.store(dk_ptr + dk_keys_N[:, None] + t_T[None, :], (dk_NT * scale).to(dk_ptr.dtype.element_ty),
                 mask=t_mask)
    tl.store(dv_ptr + (key_start + n_N)[:, None] * stride_dvt + kv_head * stride_dvh + w_W[None, :],
             dv_NW.to(dv_ptr.dtype.element_ty), mask=v_mask)


@triton.jit
def _dq_tile(k_ptr, v_ptr, k_desc, v_desc, q_MD, q_MT, do_MW, lse2_M, delta_M, dq_MD, dq_MT, key_start, start_n, len_k,
             kv_head, offset, i_M, row_ok_M, n_base, d_D, d_ok_D, t_T, t_ok_T, w_W, w_ok_W, qk_scale_log2, stride_kt,
             stride_kh, stride_vt, stride_vh, MASKED: tl.constexpr, CAUSAL: tl.constexpr, USE_TMA: tl.constexpr,
             HEAD_DIM: tl.constexpr, TAIL: tl.constexpr):
    """dQ of one query tile += the contributions of one key tile. Unmasked tiles hold only keys every row of
    the query tile sees. TAIL: the head's features past BLOCK_D (q_MT, dq_MT; mok/kernels/attention.py split_head)."""
    n_N = start_n + n_base
    k_keys_N = (key_start + n_N) * stride_kt + kv_head * stride_kh
    v_keys_N = (key_start + n_N) * stride_vt + kv_head * stride_vh
    if MASKED:
        key_ok_N = n_N < len_k
    else:
        key_ok_N = n_N >= 0
    if MASKED:
        k_ND = tl.load(k_ptr + k_keys_N[:, None] + d_D[None, :], mask=key_ok_N[:, None] & d_ok_D[None, :], other=0.0)
        v_NW = tl.load(v_ptr + v_keys_N[:, None] + w_W[None, :], mask=key_ok_N[:, None] & w_ok_W[None, :], other=0.0)
    elif USE_TMA:  # (no tail, VALUE_DIM == HEAD_DIM: the launcher's condition)
        k_ND = k_desc.load([(key_start + start_n).to(tl.int32), (kv_head * HEAD_DIM).to(tl.int32)])
        v_NW = v_desc.load([(key_start + start_n).to(tl.int32), (kv_head * HEAD_DIM).to(tl.int32)])
    else:
        k_ND = tl.load(k_ptr + k_keys_N[:, None] + d_D[None, :], mask=d_ok_D[None, :], other=0.0)
        v_NW = tl.load(v_ptr + v_keys_N[:, None] + w_W[None, :], mask=w_ok_W[None, :], other=0.0)
    if TAIL:
        k_NT = tl.load(k_ptr + k_keys_N[:, None] + t_T[None, :], mask=key_ok_N[:, None] & t_ok_T[None, :], other=0.0)
    else:
        k_NT = k_ND  # (unused)
    p_MN = tl.exp2(_scores(q_MD, tl.trans(k_ND), q_MT, tl.trans(k_NT), TAIL) * qk_scale_log2 - lse2_M[:, None])
    if MASKED:
        keep_MN = row_ok_M[:, None] & key_ok_N[None, :]
        if CAUSAL:
            keep_MN = keep_MN & (n_N[None, :] <= offset + i_M[:, None])
        p_MN = tl.where(keep_MN, p_MN, 0.0)
    dp_MN = tl.dot(do_MW, tl.trans(v_NW), input_precision="ieee")
    ds_MN = (p_MN * (dp_MN - delta_M[:, None])).to(k_ND.dtype)
    dq_MD = tl.dot(ds_MN, k_ND, dq_MD, input_precision="ieee")
    if TAIL:
        dq_MT = tl.dot(ds_MN, k_NT, dq_MT, input_precision="ieee")
    return dq_MD, dq_MT


@cached_launch
@triton.jit
def _attention_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, grad_ptr, k_desc, v_desc, lse_ptr, delta_ptr, dq_ptr, cu_q_ptr, cu_k_ptr, num_seqs, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh, stride_lt,
    stride_dqt, stride_dqh,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TAIL: tl.constexpr,
    BLOCK_T: tl.constexpr, VALUE_DIM: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PACK: tl.constexpr, USE_TMA: tl.constexpr,
):
    # A tile holds BLOCK_M // PACK queries times PACK query heads of one key/value group (as the forward's), so
    # that a key tile read serves PACK heads: MLA's 128 heads share one latent key head.
    BLOCK_Q: tl.constexpr = BLOCK_M // PACK
    seq, tile, q_start, len_q = _tile_of_program(cu_q_ptr, tl.program_id(0), num_seqs, BLOCK_Q)
    num_tiles = tl.cdiv(len_q, BLOCK_Q)
    if tile >= num_tiles:
        return
    q_tile = num_tiles - 1 - tile
    head_chunk = tl.program_id(1)
    kv_head = head_chunk * PACK // GROUP
    key_start = tl.load(cu_k_ptr + seq).to(tl.int64)
    len_k = tl.load(cu_k_ptr + seq + 1).to(tl.int64) - key_start
    offset = len_k - len_q
    rows_M = tl.arange(0, BLOCK_M)
    i_M = q_tile * BLOCK_Q + (rows_M // PACK).to(tl.int64)
    head_M = head_chunk * PACK + rows_M % PACK
    row_ok_M = i_M < len_q
    d_D = tl.arange(0, BLOCK_D)
    d_ok_D = d_D < HEAD_DIM
    t_T = BLOCK_D + tl.arange(0, BLOCK_T)
    t_ok_T = t_T < HEAD_DIM
    w_W = tl.arange(0, BLOCK_W)
    w_ok_W = w_W < VALUE_DIM
    row_mask = row_ok_M[:, None] & d_ok_D[None, :]
    tail_mask = row_ok_M[:, None] & t_ok_T[None, :]
    q_rows_M = (q_start + i_M) * stride_qt + head_M * stride_qh
    q_MD = tl.load(q_ptr + q_rows_M[:, None] + d_D[None, :], mask=row_mask, other=0.0)
    do_MW = tl.load(grad_ptr + ((q_start + i_M) * stride_gt + head_M * stride_gh)[:, None] + w_W[None, :],
                    mask=row_ok_M[:, None] & w_ok_W[None, :], other=0.0)
    lse2_M = tl.load(lse_ptr + (q_start + i_M) * stride_lt + head_M, mask=row_ok_M, other=0.0) * LOG2E
    delta_M = tl.load(delta_ptr + (q_start + i_M) * stride_lt + head_M, mask=row_ok_M, other=0.0)
    if CAUSAL:
        full_end = (offset + q_tile * BLOCK_Q + 1) // BLOCK_N * BLOCK_N  # keys every row of the tile sees
        key_end = tl.minimum(len_k, offset + tl.minimum((q_tile + 1) * BLOCK_Q, len_q))
    else:
        full_end = len_k // BLOCK_N * BLOCK_N
        key_end = len_k
    qk_scale_log2 = scale * LOG2E
    dq_MD = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    if TAIL:
        q_MT = tl.load(q_ptr + q_rows_M[:, None] + t_T[None, :], mask=tail_mask, other=0.0)
        dq_MT = tl.zeros((BLOCK_M, BLOCK_T), tl.float32)
    else:  # (unused; a small loop-carried placeholder, never a second accumulator's registers)
        q_MT = q_MD
        dq_MT = tl.zeros((16, 16), tl.float32)
    n_base = tl.arange(0, BLOCK_N).to(tl.int64)
    for start_n in range(0, full_end, BLOCK_N):
        dq_MD, dq_MT = _dq_tile(k_ptr, v_ptr, k_desc, v_desc, q_MD, q_MT, do_MW, lse2_M, delta_M, dq_MD, dq_MT,
                                key_start, start_n, len_k, kv_head, offset, i_M, row_ok_M, n_base, d_D, d_ok_D, t_T,
                                t_ok_T, w_W, w_ok_W, qk_scale_log2, stride_kt, stride_kh, stride_vt, stride_vh, False,
                                CAUSAL, USE_TMA, HEAD_DIM, TAIL)
    for start_n in range(full_end, key_end, BLOCK_N):
        dq_MD, dq_MT = _dq_tile(k_ptr, v_ptr, k_desc, v_desc, q_MD, q_MT, do_MW, lse2_M, delta_M, dq_MD, dq_MT,
                                key_start, start_n, len_k, kv_head, offset, i_M, row_ok_M, n_base, d_D, d_ok_D, t_T,
                                t_ok_T, w_W, w_ok_W, qk_scale_log2, stride_kt, stride_kh, stride_vt, stride_vh, True,
                                CAUSAL, USE_TMA, HEAD_DIM, TAIL)
    dq_rows_M = (q_start + i_M) * stride_dqt + head_M * stride_dqh
    tl.store(dq_ptr + dq_rows_M[:, None] + d_D[None, :], (dq_MD * scale).to(dq_ptr.dtype.element_ty), mask=row_mask)
    if TAIL:
        tl.store(dq_ptr + dq_rows_M[:, None] + t_T[None, :], (dq_MT * scale).to(dq_ptr.dtype.element_ty),
                 mask=tail_mask)
