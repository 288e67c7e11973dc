"""mok.attention: varlen causal (or full) attention, batch-invariant, with GQA.

Legend: T queries (packed), S keys (packed), B sequences, Hq / Hkv query / key-value heads,
G = Hq / Hkv, D head dim, Lq / Lk one sequence's query / key count.
Forward semantics: mok/reference/attention.py (fixed key blocks from key 0, in order, online softmax
in fp32), the same on the Triton kernel; prefill, chunked prefill and decode agree bitwise per query.
Backward (deterministic, not batch-invariant): per sequence, recompute P = exp(S - lse) and form
dV = P.T dO, dS = P * (dO V.T - rowsum(dO * O)), dQ = dS K * scale, dK = dS.T Q * scale with the
sequential-K matmul of mok.ops.linear (GQA heads summed in order). No atomics. It holds a dense
[Hq, Lq, Lk] fp32 matrix per sequence: fine for training lengths of a few thousand tokens.
"""
from __future__ import annotations

import torch

from mok import hooks
from mok.errors import UnsupportedError
from mok.ops.linear import FLOAT_DTYPES, _check_device, matmul_nt_f32


def _exp(x: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cuda":
        return torch.exp(x)
    from mok.reference import elementwise

    return elementwise.exp(x)


def _sum_last(x: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cuda":
        return x.sum(-1)
    from mok.reference.reduce import sum_last

    return sum_last(x)


@torch.library.custom_op("mok::attention", mutates_args=())
def _attention_op(
    q_TQD: torch.Tensor,
    k_SKD: torch.Tensor,
    v_SKD: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    if _check_device(q_TQD, k_SKD, v_SKD) == "cuda":
        from mok.kernels import attention as kernels

        return kernels.attention_forward(q_TQD, k_SKD, v_SKD, cu_seqlens_q, cu_seqlens_k, scale, causal)
    from mok.reference import attention as reference

    return reference.attention_forward(q_TQD, k_SKD, v_SKD, cu_seqlens_q, cu_seqlens_k, scale, causal)


@_attention_op.register_fake
def _(q_TQD, k_SKD, v_SKD, cu_seqlens_q, cu_seqlens_k, scale, causal):
    return torch.empty_like(q_TQD), q_TQD.new_empty(q_TQD.shape[:2], dtype=torch.float32)


@torch.library.custom_op("mok::attention_backward", mutates_args=())
def _attention_backward_op(
    grad_TQD: torch.Tensor,
    q_TQD: torch.Tensor,
    k_SKD: torch.Tensor,
    v_SKD: torch.Tensor,
    out_TQD: torch.Tensor,
    lse_TQ: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n_q_heads, head_dim = q_TQD.shape[1:]
    n_kv_heads = k_SKD.shape[1]
    group = n_q_heads // n_kv_heads
    grad_q = torch.zeros(q_TQD.shape, dtype=torch.float32, device=q_TQD.device)
    grad_k = torch.zeros(k_SKD.shape, dtype=torch.float32, device=q_TQD.device)
    grad_v = torch.zeros(v_SKD.shape, dtype=torch.float32, device=q_TQD.device)
    cu_q = cu_seqlens_q.tolist()
    cu_k = cu_seqlens_k.tolist()
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        len_q, len_k = q1 - q0, k1 - k0
        if len_q == 0:
            continue
        q_QLD = q_TQD[q0:q1].float().permute(1, 0, 2)
        do_QLD = grad_TQD[q0:q1].float().permute(1, 0, 2)
        o_QLD = out_TQD[q0:q1].float().permute(1, 0, 2)
        k_QSD = k_SKD[k0:k1].float().permute(1, 0, 2).repeat_interleave(group, dim=0)
        v_QSD = v_SKD[k0:k1].float().permute(1, 0, 2).repeat_interleave(group, dim=0)
        lse_QL = lse_TQ[q0:q1].t()

        scores_QLS = matmul_nt_f32(q_QLD, k_QSD) * scale
        p_QLS = _exp(scores_QLS - lse_QL[:, :, None])
        if causal:
            query_pos_L = torch.arange(len_q, device=q_TQD.device) + (len_k - len_q)
            visible_LS = torch.arange(len_k, device=q_TQD.device)[None, :] <= query_pos_L[:, None]
            p_QLS = torch.where(visible_LS[None], p_QLS, 0.0)
        delta_QL = _sum_last(do_QLD * o_QLD)

        dv_QSD = matmul_nt_f32(p_QLS.transpose(1, 2), do_QLD.transpose(1, 2))
        dp_QLS = matmul_nt_f32(do_QLD, v_QSD)
        ds_QLS = p_QLS * (dp_QLS - delta_QL[:, :, None])
        dq_QLD = matmul_nt_f32(ds_QLS, k_QSD.transpose(1, 2)) * scale
        dk_QSD = matmul_nt_f32(ds_QLS.transpose(1, 2), q_QLD.transpose(1, 2)) * scale

        grad_q[q0:q1] = dq_QLD.permute(1, 0, 2)
        dk_KGSD = dk_QSD.reshape(n_kv_heads, group, len_k, head_dim)
        dv_KGSD = dv_QSD.reshape(n_kv_heads, group, len_k, head_dim)
        dk_KSD, dv_KSD = dk_KGSD[:, 0].clone(), dv_KGSD[:, 0].clone()
        for g in range(1, group):
            dk_KSD.add_(dk_KGSD[:, g])
            dv_KSD.add_(dv_KGSD[:, g])
        # Sequences own disjoint key ranges, so these are plain writes, not accumulations.
        grad_k[k0:k1] = dk_KSD.permute(1, 0, 2)
        grad_v[k0:k1] = dv_KSD.permute(1, 0, 2)
    return grad_q.to(q_TQD.dtype), grad_k.to(k_SKD.dtype), grad_v.to(v_SKD.dtype)


@_attention_backward_op.register_fake
def _(grad_TQD, q_TQD, k_SKD, v_SKD, out_TQD, lse_TQ, cu_seqlens_q, cu_seqlens_k, scale, causal):
    return torch.empty_like(q_TQD), torch.empty_like(k_SKD), torch.empty_like(v_SKD)


def _setup_context(ctx, inputs, output):
    q_TQD, k_SKD, v_SKD, cu_seqlens_q, cu_seqlens_k, scale, causal = inputs
    ctx.save_for_backward(q_TQD, k_SKD, v_SKD, output[0], output[1], cu_seqlens_q, cu_seqlens_k)
    ctx.scale, ctx.causal = scale, causal


def _backward(ctx, grad_out_TQD, grad_lse_TQ):
    q_TQD, k_SKD, v_SKD, out_TQD, lse_TQ, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    if grad_out_TQD is None:
        return None, None, None, None, None, None, None
    grads = _attention_backward_op(
        grad_out_TQD.contiguous(), q_TQD, k_SKD, v_SKD, out_TQD, lse_TQ, cu_seqlens_q, cu_seqlens_k, ctx.scale, ctx.causal
    )
    return grads[0], grads[1], grads[2], None, None, None, None


torch.library.register_autograd("mok::attention", _backward, setup_context=_setup_context)


def _check(q_TQD, k_SKD, v_SKD, cu_seqlens_q, cu_seqlens_k) -> None:
    if q_TQD.dtype not in FLOAT_DTYPES or k_SKD.dtype != q_TQD.dtype or v_SKD.dtype != q_TQD.dtype:
        raise UnsupportedError(f"attention: q/k/v dtypes {q_TQD.dtype}/{k_SKD.dtype}/{v_SKD.dtype} must be one of {FLOAT_DTYPES}")
    if q_TQD.dim() != 3 or k_SKD.dim() != 3 or k_SKD.shape != v_SKD.shape or q_TQD.shape[2] != k_SKD.shape[2]:
        raise UnsupportedError(f"attention: q {tuple(q_TQD.shape)}, k {tuple(k_SKD.shape)}, v {tuple(v_SKD.shape)} must be [T, Hq, D], [S, Hkv, D], [S, Hkv, D]")
    if q_TQD.shape[1] % k_SKD.shape[1]:
        raise UnsupportedError(f"attention: {q_TQD.shape[1]} query heads are not a multiple of {k_SKD.shape[1]} key/value heads")
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.numel() < 2:
        raise UnsupportedError(f"attention: cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k {tuple(cu_seqlens_k.shape)} must both be [B + 1]")
    if cu_seqlens_q.dtype.is_floating_point or cu_seqlens_k.dtype.is_floating_point:
        raise UnsupportedError("attention: cu_seqlens must be integer tensors")
    cu_q, cu_k = cu_seqlens_q.long().cpu(), cu_seqlens_k.long().cpu()
    lens_q, lens_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    if cu_q[0] != 0 or cu_k[0] != 0 or (lens_q < 0).any() or (lens_k < 0).any():
        raise UnsupportedError("attention: cu_seqlens must start at 0 and be non-decreasing")
    if int(cu_q[-1]) != q_TQD.shape[0] or int(cu_k[-1]) > k_SKD.shape[0]:
        raise UnsupportedError(f"attention: cu_seqlens_q ends at {int(cu_q[-1])} (want T={q_TQD.shape[0]}), cu_seqlens_k at {int(cu_k[-1])} (S={k_SKD.shape[0]})")
    if ((lens_q > lens_k) | ((lens_q > 0) & (lens_k == 0))).any():
        raise UnsupportedError("attention: every sequence needs at least as many keys as queries (queries are its last keys)")


def attention(
    q_TQD: torch.Tensor,
    k_SKD: torch.Tensor,
    v_SKD: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    *,
    causal: bool = True,
    name: str | None = None,
) -> torch.Tensor:
    """Varlen attention, batch-invariant per query.

    q_TQD: [T, Hq, D]; k_SKD, v_SKD: [S, Hkv, D] (same float dtype, Hq a multiple of Hkv);
    cu_seqlens_q / cu_seqlens_k: int [B + 1] prefix sums of per-sequence query / key counts. The
    queries of sequence b are the LAST len_q of its len_k keys (prefill: len_q == len_k; decode:
    len_q == 1; chunked prefill in between). scale: softmax scale (usually D ** -0.5).
    Returns [T, Hq, D] in q's dtype. Differentiable w.r.t. q, k, v (deterministic backward).
    `name`: when set and observed, emits (name, out, "output") only: attention is not a per-row op (a
    query's output depends on its sequence's keys), so no input row determines an output row, and
    verify aligns it across traces by its output rows.
    """
    _check(q_TQD, k_SKD, v_SKD, cu_seqlens_q, cu_seqlens_k)
    observed = name is not None and hooks.observed()
    out_TQD, _ = _attention_op(
        q_TQD.contiguous(), k_SKD.contiguous(), v_SKD.contiguous(),
        cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32), float(scale), bool(causal),
    )
    if observed:
        hooks.emit(name, out_TQD, "output")
    return out_TQD
