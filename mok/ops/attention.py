"""mok.attention and mok.paged_attention: one deterministic attention, batch-invariant per query, with GQA.

Shapes: docs/shapes.md (q_TQD: T queries packed; k_SGD, v_SGD: S keys packed; key_cache_PZGD: P pages of
Z keys; G key/value heads, each shared by Q / G query heads).
Forward semantics: mok/reference/attention.py (key blocks of fixed length from key 0, in order, online
softmax in fp32); the Triton flash kernel of mok/kernels/attention.py computes the same bits whether
the keys are packed (training, `mok.attention`) or paged (inference, `mok.paged_attention`), and
whatever the batch, the tile or the path: prefill, chunked prefill and decode agree bitwise per query.
Backward (deterministic, not batch-invariant): recomputed from the saved log-sum-exp; CUDA: flash
kernels with memory linear in the sequence length; CPU: the reference's dense per-sequence math.
No host synchronisation on CUDA: cu_seqlens values are checked only where they live on the CPU.
Each op's default implementation is the CPU reference path; the CUDA kernels are registered with
register_kernel("cuda").
"""
from __future__ import annotations

import torch

from mok import hooks
from mok.errors import UnsupportedError
from mok.ops import dispatch
from mok.ops.checks import FLOAT_DTYPES, check_bool, check_device, check_name, check_real, check_tensor
from mok.reference import attention as reference


@torch.library.custom_op("mok::attention", mutates_args=())
def _attention_op(
    q_TQD: torch.Tensor,
    k_SGD: torch.Tensor,
    v_SGD: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (out [T, Q, W] in q's dtype, lse fp32 [T, Q])."""
    check_device(q_TQD, k_SGD, v_SGD)
    return reference.attention_forward(q_TQD, k_SGD, v_SGD, cu_seqlens_q, cu_seqlens_k, scale, causal)


def _attention_cuda(q_TQD, k_SGD, v_SGD, cu_seqlens_q, cu_seqlens_k, scale, causal):
    check_device(q_TQD, k_SGD, v_SGD)
    from mok.kernels import attention as kernels

    return kernels.attention_forward(q_TQD, k_SGD, v_SGD, cu_seqlens_q, cu_seqlens_k, scale, causal)


@_attention_op.register_fake
def _(q_TQD, k_SGD, v_SGD, cu_seqlens_q, cu_seqlens_k, scale, causal):
    out_TQW = q_TQD.new_empty((*q_TQD.shape[:2], v_SGD.shape[2]))
    return out_TQW, q_TQD.new_empty(q_TQD.shape[:2], dtype=torch.float32)


@torch.library.custom_op("mok::attention_backward", mutates_args=())
def _attention_backward_op(
    grad_TQD: torch.Tensor,
    q_TQD: torch.Tensor,
    k_SGD: torch.Tensor,
    v_SGD: torch.Tensor,
    out_TQD: torch.Tensor,
    lse_TQ: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_device(q_TQD, k_SGD, v_SGD)
    return reference.attention_backward(grad_TQD, q_TQD, k_SGD, v_SGD, out_TQD, lse_TQ, cu_seqlens_q, cu_seqlens_k,
                                        scale, causal)


def _attention_backward_cuda(grad_TQD, q_TQD, k_SGD, v_SGD, out_TQD, lse_TQ, cu_seqlens_q, cu_seqlens_k, scale,
                             causal):
    check_device(q_TQD, k_SGD, v_SGD)
    from mok.kernels import attention as kernels

    return kernels.attention_backward(grad_TQD, q_TQD, k_SGD, v_SGD, out_TQD, lse_TQ, cu_seqlens_q, cu_seqlens_k,
                                      scale, causal)


@_attention_backward_op.register_fake
def _(grad_TQD, q_TQD, k_SGD, v_SGD, out_TQD, lse_TQ, cu_seqlens_q, cu_seqlens_k, scale, causal):
    return torch.empty_like(q_TQD), torch.empty_like(k_SGD), torch.empty_like(v_SGD)


def _setup_context(ctx, inputs, output):
    q_TQD, k_SGD, v_SGD, cu_seqlens_q, cu_seqlens_k, scale, causal = inputs
    ctx.save_for_backward(q_TQD, k_SGD, v_SGD, output[0], output[1], cu_seqlens_q, cu_seqlens_k)
    ctx.scale, ctx.causal = scale, causal
    ctx.set_materialize_grads(False)  # the lse output's gradient is never read: None, not a zero tensor


def _backward(ctx, grad_out_TQD, grad_lse_TQ):
    q_TQD, k_SGD, v_SGD, out_TQD, lse_TQ, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    if grad_out_TQD is None:
        return None, None, None, None, None, None, None
    grad_q_TQD, grad_k_SGD, grad_v_SGD = _attention_backward(
        grad_out_TQD.contiguous(), q_TQD, k_SGD, v_SGD, out_TQD, lse_TQ, cu_seqlens_q, cu_seqlens_k, ctx.scale,
        ctx.causal)
    return grad_q_TQD, grad_k_SGD, grad_v_SGD, None, None, None, None


_attention = dispatch.register(_attention_op, cuda=_attention_cuda, backward=_backward, setup_context=_setup_context)
_attention_backward = dispatch.register(_attention_backward_op, cuda=_attention_backward_cuda)


def _check(q_TQD, k_SGD, v_SGD, cu_seqlens_q, cu_seqlens_k) -> None:
    for label, t in (("q", q_TQD), ("k", k_SGD), ("v", v_SGD), ("cu_seqlens_q", cu_seqlens_q),
                     ("cu_seqlens_k", cu_seqlens_k)):
        check_tensor(t, f"attention: {label}")
    if q_TQD.dtype not in FLOAT_DTYPES or k_SGD.dtype != q_TQD.dtype or v_SGD.dtype != q_TQD.dtype:
        raise UnsupportedError(
            f"attention: q/k/v dtypes {q_TQD.dtype}/{k_SGD.dtype}/{v_SGD.dtype} must be one of {FLOAT_DTYPES}")
    if q_TQD.dim() != 3 or k_SGD.dim() != 3 or v_SGD.dim() != 3 or k_SGD.shape[:2] != v_SGD.shape[:2] \
            or q_TQD.shape[2] != k_SGD.shape[2] or v_SGD.shape[2] == 0:
        raise UnsupportedError(f"attention: q {tuple(q_TQD.shape)}, k {tuple(k_SGD.shape)}, v {tuple(v_SGD.shape)} "
                               "must be [T, Q, D], [S, G, D], [S, G, W]")
    if k_SGD.shape[1] == 0 or q_TQD.shape[1] % k_SGD.shape[1]:
        raise UnsupportedError(
            f"attention: {q_TQD.shape[1]} query heads are not a multiple of {k_SGD.shape[1]} key/value heads")
    for label, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t.device != q_TQD.device:  # the kernels read them through a pointer on q's device
            raise UnsupportedError(f"attention: {label} must be on q's device {q_TQD.device}, got {t.device}")
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.numel() < 2:
        raise UnsupportedError(f"attention: cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k "
                               f"{tuple(cu_seqlens_k.shape)} must both be [B + 1]")
    if cu_seqlens_q.dtype.is_floating_point or cu_seqlens_k.dtype.is_floating_point:
        raise UnsupportedError("attention: cu_seqlens must be integer tensors")
    if cu_seqlens_q.device.type != "cpu" or cu_seqlens_k.device.type != "cpu" or torch.compiler.is_compiling():
        return  # reading device values would synchronise with the host: sizes only
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    lens_q, lens_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    if cu_q[0] != 0 or cu_k[0] != 0 or (lens_q < 0).any() or (lens_k < 0).any():
        raise UnsupportedError("attention: cu_seqlens must start at 0 and be non-decreasing")
    if int(cu_q[-1]) != q_TQD.shape[0] or int(cu_k[-1]) > k_SGD.shape[0]:
        raise UnsupportedError(f"attention: cu_seqlens_q ends at {int(cu_q[-1])} (want T={q_TQD.shape[0]}), "
                               f"cu_seqlens_k at {int(cu_k[-1])} (S={k_SGD.shape[0]})")
    if ((lens_q > lens_k) | ((lens_q > 0) & (lens_k == 0))).any():
        raise UnsupportedError(
            "attention: every sequence needs at least as many keys as queries (queries are its last keys)")


def attention(
    q_TQD: torch.Tensor,
    k_SGD: torch.Tensor,
    v_SGD: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    *,
    causal: bool = True,
    name: str | None = None,
) -> torch.Tensor:
    """Varlen attention, batch-invariant per query.

    q_TQD: [T, Q, D]; k_SGD: [S, G, D]; v_SGD: [S, G, W] (same float dtype, Q a multiple of G; W may differ
    from D: Multi-head Latent Attention's absorbed form has D = 576, W = 512);
    cu_seqlens_q / cu_seqlens_k: int [B + 1] prefix sums of per-sequence query / key counts. The
    queries of sequence b are the LAST len_q of its len_k keys (prefill: len_q == len_k; decode:
    len_q == 1; chunked prefill in between). scale: softmax scale (usually D ** -0.5).
    Returns [T, Q, W] in q's dtype. Differentiable w.r.t. q, k, v (deterministic backward).
    `name`: when set and observed, emits (name, out, "output") only: attention is not a per-row op (a
    query's output depends on its sequence's keys), so no input row determines an output row, and
    verify aligns it across traces by its output rows.
    """
    check_name(name, "attention")
    _check(q_TQD, k_SGD, v_SGD, cu_seqlens_q, cu_seqlens_k)
    scale = check_real(scale, "attention: scale")
    causal = check_bool(causal, "attention: causal")
    observed = name is not None and hooks.observed()
    out_TQD, _ = _attention(
        q_TQD.contiguous(), k_SGD.contiguous(), v_SGD.contiguous(),
        cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32), float(scale), bool(causal),
    )
    if observed:
        hooks.emit(name, out_TQD, "output")
    return out_TQD


# ---------------------------------------------------------------------------------------------
# inference over a paged KV cache


@torch.library.custom_op("mok::paged_attention", mutates_args=())
def _paged_attention_op(q_TQD: torch.Tensor, key_cache_PZGD: torch.Tensor, value_cache_PZGD: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor, block_table_BP: torch.Tensor,
                        scale: float, decode: bool) -> torch.Tensor:
    check_device(q_TQD, key_cache_PZGD, value_cache_PZGD)
    return reference.paged_attention_forward(q_TQD, key_cache_PZGD, value_cache_PZGD, cu_seqlens_q, seq_lens_k,
                                             block_table_BP, scale)[0]


def _paged_attention_cuda(q_TQD, key_cache_PZGD, value_cache_PZGD, cu_seqlens_q, seq_lens_k, block_table_BP, scale,
                          decode):
    check_device(q_TQD, key_cache_PZGD, value_cache_PZGD)
    from mok.kernels import attention as kernels

    return kernels.paged_attention_forward(q_TQD, key_cache_PZGD, value_cache_PZGD, cu_seqlens_q, seq_lens_k,
                                           block_table_BP, scale, decode=decode)[0]


@_paged_attention_op.register_fake
def _(q_TQD, key_cache_PZGD, value_cache_PZGD, cu_seqlens_q, seq_lens_k, block_table_BP, scale, decode):
    return q_TQD.new_empty((*q_TQD.shape[:2], value_cache_PZGD.shape[3]))


_paged_attention = dispatch.register(_paged_attention_op, cuda=_paged_attention_cuda)


@torch.library.custom_op("mok::write_kv_cache", mutates_args=("key_cache_PZGD", "value_cache_PZGD"))
def _write_kv_cache_op(k_TGD: torch.Tensor, v_TGD: torch.Tensor, key_cache_PZGD: torch.Tensor,
                       value_cache_PZGD: torch.Tensor, slot_mapping_T: torch.Tensor) -> None:
    check_device(k_TGD, v_TGD, key_cache_PZGD, value_cache_PZGD)
    reference.write_kv_cache(k_TGD, v_TGD, key_cache_PZGD, value_cache_PZGD, slot_mapping_T)


@_write_kv_cache_op.register_kernel("cuda")
@dispatch.on_tensors_device
def _write_kv_cache_cuda(k_TGD, v_TGD, key_cache_PZGD, value_cache_PZGD, slot_mapping_T):
    check_device(k_TGD, v_TGD, key_cache_PZGD, value_cache_PZGD)
    from mok.kernels import attention as kernels

    kernels.write_kv_cache(k_TGD, v_TGD, key_cache_PZGD, value_cache_PZGD, slot_mapping_T)


def _check_cache(key_cache_PZGD: torch.Tensor, value_cache_PZGD: torch.Tensor, head_dim: int, op: str) -> None:
    if key_cache_PZGD.dim() != 4 or value_cache_PZGD.dim() != 4 \
            or key_cache_PZGD.shape[:3] != value_cache_PZGD.shape[:3] or value_cache_PZGD.shape[3] == 0 \
            or key_cache_PZGD.shape[2] == 0:
        raise UnsupportedError(f"{op}: key_cache {tuple(key_cache_PZGD.shape)} and value_cache "
                               f"{tuple(value_cache_PZGD.shape)} must be [P, Z, G, D] and [P, Z, G, W], G > 0")
    if key_cache_PZGD.shape[3] != head_dim or key_cache_PZGD.stride(3) != 1 or value_cache_PZGD.stride(3) != 1:
        raise UnsupportedError(f"{op}: the caches' last dim must be the head dim {head_dim}, contiguous")
    if key_cache_PZGD.dtype not in FLOAT_DTYPES or value_cache_PZGD.dtype != key_cache_PZGD.dtype:
        raise UnsupportedError(f"{op}: cache dtypes {key_cache_PZGD.dtype}/{value_cache_PZGD.dtype} "
                               f"must be one float dtype of {FLOAT_DTYPES}")


def paged_attention(
    q_TQD: torch.Tensor,
    key_cache_PZGD: torch.Tensor,
    value_cache_PZGD: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    block_table_BP: torch.Tensor,
    scale: float,
    *,
    decode: bool = False,
) -> torch.Tensor:
    """Causal attention over a paged KV cache (vLLM's block tables), the same bits as mok.attention.

    q_TQD: [T, Q, D], the new queries of B sequences, packed; key_cache_PZGD / value_cache_PZGD:
    [P, Z, G, D] / [P, Z, G, W] (P pages of Z slots; any page, slot and head strides, D contiguous; q's
    dtype; W may differ from D, e.g. value views of a latent cache's first W features);
    cu_seqlens_q: int32 [B + 1] offsets into T; seq_lens_k: int32 [B] keys of each sequence, the new
    ones included (its queries are its last keys); block_table_BP: int32 [B, pages per sequence], the
    page of each sequence's keys z * Z .. z * Z + Z - 1. decode=True packs the query heads of a
    key/value group into one tile (for few queries per sequence; same bits). Not differentiable.
    Returns [T, Q, W] in q's dtype. No host synchronisation and no allocation that depends on values:
    capturable in a CUDA graph.
    Values out of range (cu_seqlens_q not running from 0 to T, a sequence with fewer keys than queries or
    more than its block-table row holds, a used page outside [0, P); entries past a sequence's
    ceil(seq_lens_k / Z) pages are never read and may hold anything): on the CPU they raise
    mok.UnsupportedError naming the first one (the values are on the host, reading them costs nothing).
    On CUDA they are not read on the host (that would synchronise) and the kernel does not check them: the
    caller keeps them in range (vLLM's scheduler does); out of range, the kernel reads outside the cache
    or the block table, so the output is undefined and the launch may fault with an illegal memory access.
    """
    for label, t in (("q", q_TQD), ("key_cache", key_cache_PZGD), ("value_cache", value_cache_PZGD),
                     ("cu_seqlens_q", cu_seqlens_q), ("seq_lens_k", seq_lens_k), ("block_table", block_table_BP)):
        check_tensor(t, f"paged attention: {label}")
    scale = check_real(scale, "paged attention: scale")
    decode = check_bool(decode, "paged attention: decode")
    if q_TQD.dim() != 3 or q_TQD.dtype not in FLOAT_DTYPES:
        raise UnsupportedError(f"paged attention: q must be a float [T, Q, D] tensor, got {tuple(q_TQD.shape)} "
                               f"{q_TQD.dtype}")
    _check_cache(key_cache_PZGD, value_cache_PZGD, q_TQD.shape[2], "paged attention")
    if key_cache_PZGD.dtype != q_TQD.dtype:
        raise UnsupportedError(f"paged attention: cache dtype {key_cache_PZGD.dtype} differs from q's {q_TQD.dtype}")
    if q_TQD.shape[1] % key_cache_PZGD.shape[2]:
        raise UnsupportedError(f"paged attention: {q_TQD.shape[1]} query heads are not a multiple of "
                               f"{key_cache_PZGD.shape[2]} key/value heads")
    num_seqs = cu_seqlens_q.numel() - 1
    if cu_seqlens_q.dim() != 1 or seq_lens_k.shape != (num_seqs,) or block_table_BP.dim() != 2 \
            or block_table_BP.shape[0] < num_seqs:
        raise UnsupportedError(f"paged attention: cu_seqlens_q {tuple(cu_seqlens_q.shape)}, seq_lens_k "
                               f"{tuple(seq_lens_k.shape)}, block_table {tuple(block_table_BP.shape)} must be [B + 1], "
                               "[B], [B, pages]")
    for label, t in (("cu_seqlens_q", cu_seqlens_q), ("seq_lens_k", seq_lens_k), ("block_table", block_table_BP)):
        if t.dtype != torch.int32 or t.device != q_TQD.device:
            raise UnsupportedError(f"paged attention: {label} must be int32 on {q_TQD.device}, got {t.dtype} on "
                                   f"{t.device}")
    return _paged_attention(q_TQD.contiguous(), key_cache_PZGD, value_cache_PZGD, cu_seqlens_q, seq_lens_k,
                               block_table_BP, float(scale), bool(decode))


def write_kv_cache(k_TGD: torch.Tensor, v_TGD: torch.Tensor, key_cache_PZGD: torch.Tensor,
                   value_cache_PZGD: torch.Tensor, slot_mapping_T: torch.Tensor) -> None:
    """Write new keys and values into a paged cache, in place: token t goes to page slot // Z, row slot % Z
    of slot = slot_mapping_T[t]; a negative slot (padding) writes nothing.

    k_TGD, v_TGD: [T, G, D], [T, G, W]; key_cache_PZGD, value_cache_PZGD: [P, Z, G, D], [P, Z, G, W]
    (last dims contiguous);
    slot_mapping_T: int [T] on the same device. Every slot is written by one token at most, so the
    result does not depend on the order of the writes. Capturable in a CUDA graph.
    Slots out of range: on the CPU a slot >= P * Z, or one slot given to two tokens, raises
    mok.UnsupportedError before anything is written. On CUDA the slots are not read on the host (that would
    synchronise) and the kernel does not check them: the caller keeps them in range (vLLM's scheduler
    does); a slot >= P * Z writes outside the cache (memory corruption, or an illegal-memory-access fault),
    and of two tokens given one slot, which one's row lands is unspecified.
    """
    for label, t in (("k", k_TGD), ("v", v_TGD), ("key_cache", key_cache_PZGD), ("value_cache", value_cache_PZGD),
                     ("slot_mapping", slot_mapping_T)):
        check_tensor(t, f"write_kv_cache: {label}")
    if k_TGD.dim() != 3 or v_TGD.dim() != 3:
        raise UnsupportedError(f"write_kv_cache: k {tuple(k_TGD.shape)} and v {tuple(v_TGD.shape)} must be [T, G, D] "
                               "and [T, G, W]")
    _check_cache(key_cache_PZGD, value_cache_PZGD, k_TGD.shape[-1], "write_kv_cache")
    if v_TGD.shape[:2] != k_TGD.shape[:2] or k_TGD.shape[1] != key_cache_PZGD.shape[2] \
            or v_TGD.shape[2] != value_cache_PZGD.shape[3]:
        raise UnsupportedError(f"write_kv_cache: k {tuple(k_TGD.shape)} and v {tuple(v_TGD.shape)} must be [T, G, D] "
                               f"and [T, G, W] with G = {key_cache_PZGD.shape[2]} and the caches' D, W")
    if k_TGD.dtype != key_cache_PZGD.dtype or v_TGD.dtype != key_cache_PZGD.dtype:
        raise UnsupportedError(f"write_kv_cache: k/v dtypes {k_TGD.dtype}/{v_TGD.dtype} must be the caches' "
                               f"{key_cache_PZGD.dtype}")
    check_device(k_TGD, v_TGD, key_cache_PZGD, value_cache_PZGD, slot_mapping_T)
    if slot_mapping_T.shape != (k_TGD.shape[0],) or slot_mapping_T.dtype not in (torch.int32, torch.int64):
        raise UnsupportedError(f"write_kv_cache: slot_mapping must be int [T={k_TGD.shape[0]}], got "
                               f"{tuple(slot_mapping_T.shape)} {slot_mapping_T.dtype}")
    _write_kv_cache_op(k_TGD.contiguous(), v_TGD.contiguous(), key_cache_PZGD, value_cache_PZGD, slot_mapping_T)
