"""CPU reference of mok.attention: varlen causal attention with a fixed per-query reduction order.

Shapes: docs/shapes.md (q_TQD: T queries, all sequences packed; k_SGD, v_SGD: S keys, packed; G
key/value heads). The value head dim may differ from the query/key head dim D (v_SGD is then [S, G, W] and
the output [T, Q, W]): Multi-head Latent Attention's absorbed form attends over [kv_c, k_pe] keys with kv_c
values (rl/models/mla.py). Inside attention_forward the Q query heads are split as [G, Q / G] (a query head's
key/value head, then its place in that group), written GQ in the suffixes; the tensors of one key
block hold its active queries (T) and the block's keys (S).
Semantics (shared with the Triton kernel in mok/kernels/attention.py):
- Query i of sequence b (len_q queries, len_k keys) sits at absolute position len_k - len_q + i and
  sees keys 0..position (causal) or all len_k keys.
- Keys are visited in blocks of key_block_size(D) aligned at key 0 of the sequence, in order, and a
  query stops after the block holding its last visible key. Per block, in fp32:
  s = (q . k) * scale (masked keys -inf); m' = max(m, max(s)); alpha = exp(m - m');
  p = exp(s - m') rounded to v's dtype; l = l * alpha + sum(p); acc = acc * alpha + p @ v; m = m'.
  out = acc / l rounded to q's dtype, lse = m + log(l).
So a query's bits depend only on its own q and its sequence's keys: prefill, chunked prefill and
one-token decode give identical results. The CPU sums over D and over a block's keys run sequentially
in index order.
"""
from __future__ import annotations

import math

import torch

from mok.errors import UnsupportedError
from mok.reference import elementwise
from mok.reference.linear import bmm_nt
from mok.reference.reduce import sum_last


def key_block_size(head_dim: int) -> int:
    """The key block length: a function of the head dim only (the GPU kernel uses the same)."""
    return 64 if head_dim <= 128 else 32


def query_layout(
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query (int64 [T] each, CPU): index of its sequence's first key, number of keys it sees."""
    cu_q = cu_seqlens_q.long().cpu()
    cu_k = cu_seqlens_k.long().cpu()
    lens_q = cu_q[1:] - cu_q[:-1]
    lens_k = cu_k[1:] - cu_k[:-1]
    seq_T = torch.repeat_interleave(torch.arange(lens_q.numel()), lens_q)
    index_in_seq_T = torch.arange(seq_T.numel()) - cu_q[:-1][seq_T]
    if causal:
        visible_T = (lens_k - lens_q)[seq_T] + index_in_seq_T + 1
    else:
        visible_T = lens_k[seq_T]
    return cu_k[:-1][seq_T], visible_T


def attention_forward(
    q_TQD: torch.Tensor,
    k_SGD: torch.Tensor,
    v_SGD: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns out [T, Q, W] in q's dtype and lse fp32 [T, Q] (natural log of the softmax sum)."""
    num_tokens, num_q_heads, head_dim = q_TQD.shape
    num_kv_heads, value_dim = k_SGD.shape[1], v_SGD.shape[2]
    group = num_q_heads // num_kv_heads
    block = key_block_size(head_dim)
    key_start_T, visible_T = query_layout(cu_seqlens_q, cu_seqlens_k, causal)

    q_DTGQ = q_TQD.float().reshape(num_tokens, num_kv_heads, group, head_dim).permute(3, 0, 1, 2).contiguous()
    k_DSG = k_SGD.float().permute(2, 0, 1).contiguous()
    value_dtype = v_SGD.dtype
    v_SGD = v_SGD.float()
    max_TGQ = torch.full((num_tokens, num_kv_heads, group), -math.inf)
    sum_TGQ = torch.zeros(num_tokens, num_kv_heads, group)
    acc_TGQD = torch.zeros(num_tokens, num_kv_heads, group, value_dim)

    num_blocks = -(-int(visible_T.max()) // block) if num_tokens else 0
    for j in range(num_blocks):
        # this block: its active queries `rows` (T below) and its keys (S below)
        rows = torch.nonzero(visible_T > j * block)[:, 0]
        # Columns past the last visible key of every active row would only add exact zeros.
        num_cols = min(block, int(visible_T[rows].max()) - j * block)
        key_pos_S = j * block + torch.arange(num_cols)
        valid_TS = key_pos_S[None, :] < visible_T[rows][:, None]
        index_TS = torch.where(valid_TS, key_start_T[rows][:, None] + key_pos_S[None, :], 0)

        k_block_DTGS = k_DSG[:, index_TS].permute(0, 1, 3, 2)
        q_block_DTGQ = q_DTGQ[:, rows]
        scores_TGQS = torch.zeros(rows.numel(), num_kv_heads, group, num_cols)
        for d in range(head_dim):
            scores_TGQS.add_(q_block_DTGQ[d][:, :, :, None] * k_block_DTGS[d][:, :, None, :])
        scores_TGQS = torch.where(valid_TS[:, None, None, :], scores_TGQS * scale, -math.inf)

        max_old_TGQ = max_TGQ[rows]
        max_new_TGQ = torch.maximum(max_old_TGQ, scores_TGQS.amax(-1))
        alpha_TGQ = elementwise.exp(max_old_TGQ - max_new_TGQ)
        # p is rounded to v's dtype, as the tensor-core dots on the GPU take it (for p @ v and for the sum)
        p_TGQS = elementwise.exp(scores_TGQS - max_new_TGQ[..., None]).to(value_dtype).float()
        sum_TGQ[rows] = sum_TGQ[rows] * alpha_TGQ + sum_last(p_TGQS)

        acc_block_TGQD = acc_TGQD[rows] * alpha_TGQ[..., None]
        p_STGQ = p_TGQS.permute(3, 0, 1, 2)
        v_block_STGD = torch.where(valid_TS[:, :, None, None], v_SGD[index_TS], 0.0).permute(1, 0, 2, 3)
        for n in range(num_cols):
            acc_block_TGQD.add_(p_STGQ[n][..., None] * v_block_STGD[n][:, :, None, :])
        acc_TGQD[rows] = acc_block_TGQD
        max_TGQ[rows] = max_new_TGQ

    out_TQD = (acc_TGQD / sum_TGQ[..., None]).reshape(num_tokens, num_q_heads, value_dim).to(q_TQD.dtype)
    lse_TQ = (max_TGQ + elementwise.log(sum_TGQ)).reshape(num_tokens, num_q_heads)
    return out_TQD, lse_TQ


def gather_pages(cache_PZGD: torch.Tensor, seq_lens_k: torch.Tensor, block_table_BP: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys (or values) of each sequence from a paged cache, packed: -> ([S, G, D], cu_seqlens_k [B + 1])."""
    page_size = cache_PZGD.shape[1]
    lens = seq_lens_k.long().cpu().tolist()
    table = block_table_BP.long().cpu()
    rows = [cache_PZGD[table[b, : -(-n // page_size)]].flatten(0, 1)[:n] for b, n in enumerate(lens)]
    packed_SGD = torch.cat(rows) if rows else cache_PZGD.new_empty((0, *cache_PZGD.shape[2:]))
    cu_seqlens_k = torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    return packed_SGD, cu_seqlens_k


def check_paged(q_TQD: torch.Tensor, key_cache_PZGD: torch.Tensor, cu_seqlens_q: torch.Tensor,
                seq_lens_k: torch.Tensor, block_table_BP: torch.Tensor) -> None:
    """The values a paged attention reads, checked on the host (UnsupportedError naming the first bad one):
    cu_seqlens_q from 0, non-decreasing, ending at T; each seq_lens_k >= its query count and within its
    block table row (ceil(len / Z) pages); the pages it uses in [0, P). Unused table entries are not read."""
    num_pages, page_size = key_cache_PZGD.shape[:2]
    cu_q = cu_seqlens_q.long().cpu()
    lens_q = cu_q[1:] - cu_q[:-1]
    if cu_q.numel() and (int(cu_q[0]) != 0 or int(cu_q[-1]) != q_TQD.shape[0] or bool((lens_q < 0).any())):
        raise UnsupportedError(f"paged attention: cu_seqlens_q {cu_q.tolist()} must run from 0 to T="
                               f"{q_TQD.shape[0]}, non-decreasing")
    lens_k = seq_lens_k.long().cpu()
    short = torch.nonzero(lens_k < lens_q)[:, 0]
    if short.numel():
        b = int(short[0])
        raise UnsupportedError(f"paged attention: sequence {b} has seq_lens_k {int(lens_k[b])}, fewer keys than its "
                               f"{int(lens_q[b])} queries (its queries are its last keys)")
    pages_B = -(-lens_k // page_size)
    wide = torch.nonzero(pages_B > block_table_BP.shape[1])[:, 0]
    if wide.numel():
        b = int(wide[0])
        raise UnsupportedError(f"paged attention: sequence {b} has seq_lens_k {int(lens_k[b])}, more than its block "
                               f"table row holds ({block_table_BP.shape[1]} pages of {page_size})")
    table = block_table_BP[:lens_k.numel()].long().cpu()
    used = torch.arange(table.shape[1])[None, :] < pages_B[:, None]
    bad = torch.nonzero(used & ((table < 0) | (table >= num_pages)))
    if bad.numel():
        b, z = (int(i) for i in bad[0])
        raise UnsupportedError(f"paged attention: block_table[{b}, {z}] = {int(table[b, z])} is not a page of the "
                               f"cache [0, {num_pages})")


def paged_attention_forward(q_TQD: torch.Tensor, key_cache_PZGD: torch.Tensor, value_cache_PZGD: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor, block_table_BP: torch.Tensor,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention over a paged cache: the keys are gathered, then attention_forward (same bits).
    The values are checked first (`check_paged`)."""
    check_paged(q_TQD, key_cache_PZGD, cu_seqlens_q, seq_lens_k, block_table_BP)
    k_SGD, cu_seqlens_k = gather_pages(key_cache_PZGD, seq_lens_k, block_table_BP)
    v_SGD, _ = gather_pages(value_cache_PZGD, seq_lens_k, block_table_BP)
    return attention_forward(q_TQD, k_SGD, v_SGD, cu_seqlens_q, cu_seqlens_k, scale, True)


def write_kv_cache(k_TGD: torch.Tensor, v_TGD: torch.Tensor, key_cache_PZGD: torch.Tensor,
                   value_cache_PZGD: torch.Tensor, slot_mapping_T: torch.Tensor) -> None:
    """key_cache[slot // Z, slot % Z] = k (and v) for every token whose slot is >= 0 (in place).
    A slot past the cache (>= P * Z) or written by two tokens is an UnsupportedError, before any write."""
    page_size = key_cache_PZGD.shape[1]
    slots = slot_mapping_T.long().cpu()
    keep = torch.nonzero(slots >= 0)[:, 0]
    num_slots = key_cache_PZGD.shape[0] * page_size
    if keep.numel():
        high = int(slots[keep].max())
        if high >= num_slots:
            raise UnsupportedError(f"write_kv_cache: slot {high} is past the cache ({key_cache_PZGD.shape[0]} pages "
                                   f"of {page_size}: slots [0, {num_slots}))")
        if torch.unique(slots[keep]).numel() != keep.numel():
            raise UnsupportedError("write_kv_cache: a slot is written by two tokens (every slot takes one token at "
                                   "most)")
    pages, offsets = slots[keep] // page_size, slots[keep] % page_size
    key_cache_PZGD[pages, offsets] = k_TGD[keep].to(key_cache_PZGD.dtype)
    value_cache_PZGD[pages, offsets] = v_TGD[keep].to(value_cache_PZGD.dtype)


def attention_backward(grad_TQD, q_TQD, k_SGD, v_SGD, out_TQD, lse_TQ, cu_seqlens_q, cu_seqlens_k, scale, causal):
    """(d q, d k, d v) in the inputs' dtypes, deterministic (not batch-invariant): per sequence, recompute
    P = exp(scores - lse) and form dV = P.T dO, dScores = P * (dO V.T - rowsum(dO * O)), dQ = dScores K * scale,
    dK = dScores.T Q * scale with the sequential-reduction matmul (GQA heads summed in order). It holds a
    dense [Q, T, S] fp32 matrix per sequence: fine for the small models of the CPU path."""
    num_q_heads, head_dim = q_TQD.shape[1:]
    num_kv_heads, value_dim = k_SGD.shape[1], v_SGD.shape[2]
    group = num_q_heads // num_kv_heads
    grad_q_TQD = torch.zeros(q_TQD.shape, dtype=torch.float32, device=q_TQD.device)
    grad_k_SGD = torch.zeros(k_SGD.shape, dtype=torch.float32, device=q_TQD.device)
    grad_v_SGD = torch.zeros(v_SGD.shape, dtype=torch.float32, device=q_TQD.device)
    cu_q = cu_seqlens_q.tolist()
    cu_k = cu_seqlens_k.tolist()
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        len_q, len_k = q1 - q0, k1 - k0
        if len_q == 0:
            continue
        # one sequence, heads first: T its queries, S its keys (k and v repeated for each query head)
        q_QTD = q_TQD[q0:q1].float().permute(1, 0, 2)
        do_QTD = grad_TQD[q0:q1].float().permute(1, 0, 2)
        o_QTD = out_TQD[q0:q1].float().permute(1, 0, 2)
        k_QSD = k_SGD[k0:k1].float().permute(1, 0, 2).repeat_interleave(group, dim=0)
        v_QSD = v_SGD[k0:k1].float().permute(1, 0, 2).repeat_interleave(group, dim=0)
        lse_QT = lse_TQ[q0:q1].t()

        scores_QTS = bmm_nt(q_QTD, k_QSD) * scale
        p_QTS = elementwise.exp(scores_QTS - lse_QT[:, :, None])
        if causal:
            query_pos_T = torch.arange(len_q, device=q_TQD.device) + (len_k - len_q)
            visible_TS = torch.arange(len_k, device=q_TQD.device)[None, :] <= query_pos_T[:, None]
            p_QTS = torch.where(visible_TS[None], p_QTS, 0.0)
        delta_QT = sum_last(do_QTD * o_QTD)

        dv_QSD = bmm_nt(p_QTS.transpose(1, 2), do_QTD.transpose(1, 2))
        dp_QTS = bmm_nt(do_QTD, v_QSD)
        ds_QTS = p_QTS * (dp_QTS - delta_QT[:, :, None])
        dq_QTD = bmm_nt(ds_QTS, k_QSD.transpose(1, 2)) * scale
        dk_QSD = bmm_nt(ds_QTS.transpose(1, 2), q_QTD.transpose(1, 2)) * scale

        grad_q_TQD[q0:q1] = dq_QTD.permute(1, 0, 2)
        dk_per_head = dk_QSD.reshape(num_kv_heads, group, len_k, head_dim)  # [G, Q / G, S, D]
        dv_per_head = dv_QSD.reshape(num_kv_heads, group, len_k, value_dim)
        dk_GSD, dv_GSD = dk_per_head[:, 0].clone(), dv_per_head[:, 0].clone()
        for g in range(1, group):
            dk_GSD.add_(dk_per_head[:, g])
            dv_GSD.add_(dv_per_head[:, g])
        # Sequences own disjoint key ranges, so these are plain writes, not accumulations.
        grad_k_SGD[k0:k1] = dk_GSD.permute(1, 0, 2)
        grad_v_SGD[k0:k1] = dv_GSD.permute(1, 0, 2)
    return grad_q_TQD.to(q_TQD.dtype), grad_k_SGD.to(k_SGD.dtype), grad_v_SGD.to(v_SGD.dtype)
