"""CPU reference of mok.attention: varlen causal attention with a fixed per-query reduction order.

Legend: T queries (all sequences packed), S keys (packed), Hq query heads, Hkv key/value heads,
G = Hq / Hkv (GQA group), D head dim, N key block length, R rows (queries) active in a key block.
Semantics (shared with the Triton kernel in mok/kernels/attention.py):
- Query i of sequence b (len_q queries, len_k keys) sits at absolute position len_k - len_q + i and
  sees keys 0..position (causal) or all len_k keys.
- Keys are visited in blocks of N = key_block_size(D) aligned at key 0 of the sequence, in order,
  and a query stops after the block holding its last visible key. Per block, in fp32:
  s = (q . k) * scale (masked keys -inf); m' = max(m, max(s)); alpha = exp(m - m');
  p = exp(s - m'); l = l * alpha + sum(p); acc = acc * alpha + p.to(v.dtype) @ v; m = m'.
  out = acc / l rounded to q's dtype, lse = m + log(l).
So a query's bits depend only on its own q and its sequence's keys: prefill, chunked prefill and
one-token decode give identical results. The CPU sums over D and N run sequentially in index order.
"""
from __future__ import annotations

import math

import torch

from mok.reference import elementwise
from mok.reference.reduce import sum_last


def key_block_size(head_dim: int) -> int:
    """N, the key block length: a function of the head dim only (the GPU kernel uses the same)."""
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
    k_SKD: torch.Tensor,
    v_SKD: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns out [T, Hq, D] in q's dtype and lse fp32 [T, Hq] (natural log of the softmax sum)."""
    n_tokens, n_q_heads, head_dim = q_TQD.shape
    n_kv_heads = k_SKD.shape[1]
    group = n_q_heads // n_kv_heads
    block = key_block_size(head_dim)
    key_start_T, visible_T = query_layout(cu_seqlens_q, cu_seqlens_k, causal)

    q_DTKG = q_TQD.float().reshape(n_tokens, n_kv_heads, group, head_dim).permute(3, 0, 1, 2).contiguous()
    k_DSK = k_SKD.float().permute(2, 0, 1).contiguous()
    value_dtype = v_SKD.dtype
    v_SKD = v_SKD.float()
    max_TKG = torch.full((n_tokens, n_kv_heads, group), -math.inf)
    sum_TKG = torch.zeros(n_tokens, n_kv_heads, group)
    acc_TKGD = torch.zeros(n_tokens, n_kv_heads, group, head_dim)

    n_blocks = -(-int(visible_T.max()) // block) if n_tokens else 0
    for j in range(n_blocks):
        rows_R = torch.nonzero(visible_T > j * block)[:, 0]
        # Columns past the last visible key of every active row would only add exact zeros.
        n_cols = min(block, int(visible_T[rows_R].max()) - j * block)
        key_pos_N = j * block + torch.arange(n_cols)
        valid_RN = key_pos_N[None, :] < visible_T[rows_R][:, None]
        index_RN = torch.where(valid_RN, key_start_T[rows_R][:, None] + key_pos_N[None, :], 0)

        k_DRKN = k_DSK[:, index_RN].permute(0, 1, 3, 2)
        q_DRKG = q_DTKG[:, rows_R]
        scores_RKGN = torch.zeros(rows_R.numel(), n_kv_heads, group, n_cols)
        for d in range(head_dim):
            scores_RKGN.add_(q_DRKG[d][:, :, :, None] * k_DRKN[d][:, :, None, :])
        scores_RKGN = torch.where(valid_RN[:, None, None, :], scores_RKGN * scale, -math.inf)

        max_old_RKG = max_TKG[rows_R]
        max_new_RKG = torch.maximum(max_old_RKG, scores_RKGN.amax(-1))
        alpha_RKG = elementwise.exp(max_old_RKG - max_new_RKG)
        p_RKGN = elementwise.exp(scores_RKGN - max_new_RKG[..., None])
        sum_TKG[rows_R] = sum_TKG[rows_R] * alpha_RKG + sum_last(p_RKGN)

        acc_RKGD = acc_TKGD[rows_R] * alpha_RKG[..., None]
        # p is rounded to v's dtype before p @ v, as the tensor-core dot on the GPU takes it.
        p_NRKG = p_RKGN.to(value_dtype).float().permute(3, 0, 1, 2)
        v_NRKD = torch.where(valid_RN[:, :, None, None], v_SKD[index_RN], 0.0).permute(1, 0, 2, 3)
        for n in range(n_cols):
            acc_RKGD.add_(p_NRKG[n][..., None] * v_NRKD[n][:, :, None, :])
        acc_TKGD[rows_R] = acc_RKGD
        max_TKG[rows_R] = max_new_RKG

    out_TQD = (acc_TKGD / sum_TKG[..., None]).reshape(n_tokens, n_q_heads, head_dim).to(q_TQD.dtype)
    lse_TQ = (max_TKG + elementwise.log(sum_TKG)).reshape(n_tokens, n_q_heads)
    return out_TQD, lse_TQ
