"""Triton varlen attention forward behind mok.attention.

Legend: T queries (packed), S keys (packed), B sequences, Hq / Hkv heads, G = Hq / Hkv, D head dim,
BLOCK_M queries per program, BLOCK_N keys per block (mok.reference.attention.key_block_size(D)).
Grid (B, query blocks, Hq): a program takes BLOCK_M consecutive queries of one sequence and one head
and walks key blocks 0, 1, ... from key 0 of the sequence, in order, with an fp32 online softmax
(the semantics of mok/reference/attention.py). No split-KV: a query's reduction order is fixed by
its position alone. Where a tile runs past a query's last visible key, that row's update is exact
identity (alpha = exp(0) = 1, p = 0), so prefill, chunked prefill and one-token decode agree.
The configuration depends on D only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok.reference.attention import key_block_size


@triton.jit
def _attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, cu_q_ptr, cu_k_ptr, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lt,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq).to(tl.int64)
    len_q = tl.load(cu_q_ptr + seq + 1).to(tl.int64) - q_start
    k_start = tl.load(cu_k_ptr + seq).to(tl.int64)
    len_k = tl.load(cu_k_ptr + seq + 1).to(tl.int64) - k_start
    if q_block * BLOCK_M >= len_q:
        return
    kv_head = head // GROUP
    offs_m = q_block * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    row_ok = offs_m < len_q
    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if CAUSAL:
        visible = len_k - len_q + offs_m + 1
        key_end = tl.minimum(len_k, len_k - len_q + (q_block + 1) * BLOCK_M)
    else:
        visible = tl.zeros((BLOCK_M,), tl.int64) + len_k
        key_end = len_k

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for start_n in range(0, key_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N).to(tl.int64)
        key_ok = offs_n < len_k
        k = tl.load(k_ptr + (k_start + offs_n)[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
                    mask=key_ok[None, :] & d_ok[:, None], other=0.0)
        s = tl.dot(q, k, input_precision="ieee") * scale
        s = tl.where((offs_n[None, :] < visible[:, None]) & key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = tl.load(v_ptr + (k_start + offs_n)[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                    mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + (q_start + offs_m) * stride_lt + head, m_i + tl.log(l_i), mask=row_ok)


def attention_config(head_dim: int) -> dict:
    """The one place the configuration is chosen: from the head dim only (never the token count)."""
    return dict(BLOCK_M=64, BLOCK_N=key_block_size(head_dim), BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                num_warps=4 if head_dim <= 128 else 8, num_stages=2)


def attention_forward(
    q_TQD: torch.Tensor,
    k_SKD: torch.Tensor,
    v_SKD: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns out [T, Hq, D] in q's dtype and lse fp32 [T, Hq]. Head dims must be contiguous."""
    n_tokens, n_q_heads, head_dim = q_TQD.shape
    n_kv_heads = k_SKD.shape[1]
    out = torch.empty_like(q_TQD)
    lse = torch.empty(n_tokens, n_q_heads, dtype=torch.float32, device=q_TQD.device)
    n_seqs = cu_seqlens_q.numel() - 1
    if n_tokens == 0 or n_seqs == 0:
        return out, lse
    lens_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()
    config = attention_config(head_dim)
    grid = (n_seqs, triton.cdiv(int(lens_q), config["BLOCK_M"]), n_q_heads)
    _attention_fwd_kernel[grid](
        q_TQD, k_SKD, v_SKD, out, lse,
        cu_seqlens_q.to(device=q_TQD.device, dtype=torch.int32), cu_seqlens_k.to(device=q_TQD.device, dtype=torch.int32),
        scale,
        q_TQD.stride(0), q_TQD.stride(1), k_SKD.stride(0), k_SKD.stride(1), v_SKD.stride(0), v_SKD.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        GROUP=n_q_heads // n_kv_heads, CAUSAL=causal, HEAD_DIM=head_dim, **config,
    )
    return out, lse
