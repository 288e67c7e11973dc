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

This module holds the configs and launchers; the kernels: attention_fwd.py (forward, write_kv_cache) and
attention_bwd.py (backward).
"""
from __future__ import annotations

import torch
import triton

from mok.kernels.attention_bwd import _attention_bwd_delta_kernel, _attention_bwd_dkdv_kernel, _attention_bwd_dq_kernel
from mok.kernels.attention_fwd import _attention_fwd_kernel, _write_kv_cache_kernel
from mok.kernels.launch import INTERPRET
from mok.reference.attention import key_block_size

try:  # host-side TMA descriptors (Triton >= 3.4); without them the kernels use pointer loads
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None


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
    # a wide head (split_head: MLA's 576 = 512 + 64 query/key features, 512 value features): smaller tiles so that
    # the fp32 accumulators [rows, 512] fit the registers. forward_wide (8 tokens x 8 heads a tile: one latent key
    # tile read for 8 heads) and decode_wide (64 heads of one latent key per tile): the fastest candidates of
    # bench/attention_sweep.py --heads mla and bench/mla.py on the H100; every candidate gave the same bits
    "forward_wide": dict(BLOCK_M=64, PACK=8, num_warps=8, num_stages=2),  # PACK: at most, within the group
    "decode_wide": dict(BLOCK_M=64, num_warps=8, num_stages=2),
    "backward_dkdv_wide": dict(BLOCK_M=32, BLOCK_N=16, num_warps=8, num_stages=1, TMA=0),
    "backward_dq_wide": dict(BLOCK_M=16, BLOCK_N=32, num_warps=8, num_stages=1, TMA=0),
}
WIDE_HEAD = 256  # a q/k head dim above this is wide (its configs above; split in two when not a power of two)


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def split_head(head_dim: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_T) of a q/k head dim: the kernels' q . k is a dot over features [0, BLOCK_D), then, when
    BLOCK_T > 0, one over the tail [BLOCK_D, head_dim) padded to BLOCK_T, accumulated into the same fp32 sum.
    A wide head that is no power of two is split at its largest power of two (MLA's 576: 512 + 64) instead of
    being padded to the next one (1024: twice the registers and shared memory); other heads are one padded block."""
    block_d = _block_d(head_dim)
    if head_dim <= WIDE_HEAD or block_d == head_dim:
        return block_d, 0
    main = block_d // 2
    return main, max(16, triton.next_power_of_2(head_dim - main))


def _head_constexprs(head_dim: int, value_dim: int) -> dict:
    """The kernels' head constexprs: HEAD_DIM, BLOCK_D, TAIL, BLOCK_T (16 when unused), VALUE_DIM, BLOCK_W."""
    block_d, block_t = split_head(head_dim)
    return dict(HEAD_DIM=head_dim, BLOCK_D=block_d, TAIL=block_t > 0, BLOCK_T=max(block_t, 16),
                VALUE_DIM=value_dim, BLOCK_W=_block_d(value_dim))


def _pack_within(group: int, most: int) -> int:
    """The heads a tile packs: the largest power of two dividing the group, at most `most` (a power of two), so
    that a tile's heads are whole heads of one group."""
    pack = 1
    while group % (pack * 2) == 0 and pack * 2 <= most:
        pack *= 2
    return pack


def _forward_config(head_dim: int, group: int, decode: bool) -> dict:
    wide = head_dim > WIDE_HEAD
    if decode:
        config = dict(CONFIGS["decode_wide" if wide else "decode"])
        config["PACK"] = _pack_within(group, config["BLOCK_M"])
        # a decode step has one query per sequence: a tile wider than the packed heads would hold idle rows
        config["BLOCK_M"] = max(16, config["PACK"])
        return config
    config = dict(CONFIGS["forward_wide" if wide else "forward" if head_dim > 64 else "forward_small_d"])
    config["PACK"] = _pack_within(group, config["PACK"])
    return config


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
    """Packed keys. q_TQD [T, Q, D], k_SGD [S, G, D], v_SGD [S, G, W] (last dims contiguous), cu_seqlens_q / _k
    int32 [B + 1] on the device. -> (out [T, Q, W] in q's dtype, lse fp32 [T, Q]). No host synchronisation."""
    return _launch_forward(q_TQD, k_SGD, v_SGD, cu_seqlens_q, cu_seqlens_k, None, scale, causal, use_tma, config)


def paged_attention_forward(q_TQD: torch.Tensor, key_cache_PZGD: torch.Tensor, value_cache_PZGD: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor, block_table_BP: torch.Tensor,
                            scale: float, *, decode: bool = False, config: dict | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys in a paged cache. key_cache_PZGD / value_cache_PZGD [P, Z, G, D] / [P, Z, G, W] (any page, slot and
    head strides, last dims contiguous: read in place, e.g. vLLM's caches that interleave keys and values, or a
    latent cache whose values are its keys' first W features); seq_lens_k int32 [B] keys per sequence (its
    queries are its last keys); block_table_BP int32 [B, pages per sequence]. Causal. decode=True packs a GQA
    group's heads into one tile (for one or a few queries per sequence). -> (out [T, Q, W], lse fp32 [T, Q])."""
    head_dim = key_cache_PZGD.shape[3]
    if config is None:
        config = _forward_config(head_dim, q_TQD.shape[1] // key_cache_PZGD.shape[2], decode)
    return _launch_forward(q_TQD, key_cache_PZGD, value_cache_PZGD, cu_seqlens_q, seq_lens_k, block_table_BP,
                           scale, True, False, config)


def _launch_forward(q_TQD, k_xGD, v_xGD, cu_seqlens_q, keys, block_table_BP, scale, causal, use_tma, config):
    """k_xGD / v_xGD: packed keys [S, G, D] / [S, G, W] (block_table_BP None) or a paged cache [P, Z, G, D] /
    [P, Z, G, W]."""
    num_tokens, num_q_heads, head_dim = q_TQD.shape
    paged = block_table_BP is not None
    num_kv_heads, value_dim = k_xGD.shape[-2], v_xGD.shape[-1]
    group = num_q_heads // num_kv_heads
    out_TQD = q_TQD.new_empty(num_tokens, num_q_heads, value_dim)
    lse_TQ = torch.empty(num_tokens, num_q_heads, dtype=torch.float32, device=q_TQD.device)
    num_seqs = cu_seqlens_q.numel() - 1
    if num_tokens == 0 or num_seqs == 0:
        return out_TQD, lse_TQ
    config = dict(config or _forward_config(head_dim, group, False))
    config.setdefault("WARP_SPECIALIZE", False)
    pack = config.pop("PACK")
    block_m = config["BLOCK_M"]
    key_block = key_block_size(head_dim)
    head = _head_constexprs(head_dim, value_dim)
    k_arg, v_arg = _descriptors(use_tma and not paged and not head["TAIL"] and value_dim == head_dim, (k_xGD, v_xGD),
                                key_block)
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
        GROUP=group, PACK=pack, CAUSAL=causal, PAGED=paged, PAGE=page_size, USE_TMA=tma, KEY_BLOCK=key_block,
        INTERPRET=INTERPRET, **head, **config,
    )
    return out_TQD, lse_TQ


def attention_backward(grad_TQD: torch.Tensor, q_TQD: torch.Tensor, k_SGD: torch.Tensor, v_SGD: torch.Tensor,
                       out_TQD: torch.Tensor, lse_TQ: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       cu_seqlens_k: torch.Tensor, scale: float, causal: bool, *, configs: dict | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dq [T, Q, D], dk [S, G, D], dv [S, G, W]) in the inputs' dtypes (grad, out: [T, Q, W]). Deterministic;
    every key row of k_SGD outside the sequences gets a zero gradient. q, k and v may be strided views (last dims
    contiguous); grad and out are read as [T * Q, W] rows (copied first when not laid out so). `configs` overrides
    entries of CONFIGS (a backward entry without TMA loads through pointers)."""
    grad_TQD, out_TQD = grad_TQD.contiguous(), out_TQD.contiguous()
    num_tokens, num_q_heads, head_dim = q_TQD.shape
    num_keys, num_kv_heads, _ = k_SGD.shape
    value_dim = v_SGD.shape[2]
    num_seqs = cu_seqlens_q.numel() - 1
    dq_TQD = torch.empty_like(q_TQD)
    dk_SGD = torch.zeros_like(k_SGD)
    dv_SGD = torch.zeros_like(v_SGD)
    if num_tokens == 0 or num_seqs == 0:
        return dq_TQD, dk_SGD, dv_SGD
    delta_TQ = torch.empty(num_tokens, num_q_heads, dtype=torch.float32, device=q_TQD.device)
    config = dict(CONFIGS["backward_delta"])
    # rows x value features per program at most 64 x 128 (two fp32 tiles in registers): fewer rows for wide values
    config["BLOCK_R"] = min(config["BLOCK_R"], max(16, 8192 // _block_d(value_dim)))
    rows = num_tokens * num_q_heads
    _attention_bwd_delta_kernel[(triton.cdiv(rows, config["BLOCK_R"]),)](
        out_TQD.view(rows, value_dim), grad_TQD.view(rows, value_dim), delta_TQ, rows, value_dim, value_dim,
        HEAD_DIM=value_dim, BLOCK_D=_block_d(value_dim), **config)
    head = _head_constexprs(head_dim, value_dim)
    common = dict(GROUP=num_q_heads // num_kv_heads, CAUSAL=causal, **head)
    # TMA boxes are whole heads of one width: only where there is no tail and values are as wide as keys
    plain_head = not head["TAIL"] and value_dim == head_dim
    wide = "_wide" if head_dim > WIDE_HEAD else ""
    strides = (q_TQD.stride(0), q_TQD.stride(1), k_SGD.stride(0), k_SGD.stride(1), v_SGD.stride(0), v_SGD.stride(1),
               grad_TQD.stride(0), grad_TQD.stride(1), lse_TQ.stride(0))
    configs = {**CONFIGS, **(configs or {})}
    config = dict(configs["backward_dkdv" + wide])
    q_arg, g_arg = _descriptors(config.pop("TMA", 0) and plain_head, (q_TQD, grad_TQD), config["BLOCK_M"])
    _attention_bwd_dkdv_kernel[(num_keys // config["BLOCK_N"] + num_seqs, num_kv_heads)](
        q_TQD, k_SGD, v_SGD, grad_TQD, q_arg, g_arg, lse_TQ, delta_TQ, dk_SGD, dv_SGD, cu_seqlens_q, cu_seqlens_k,
        num_seqs, scale, *strides, dk_SGD.stride(0), dk_SGD.stride(1), dv_SGD.stride(0), dv_SGD.stride(1), **common,
        USE_TMA=q_arg is not q_TQD, **config)
    config = dict(configs["backward_dq" + wide])
    config.setdefault("PACK", 1)
    if (num_q_heads // num_kv_heads) % config["PACK"] or config["BLOCK_M"] % config["PACK"]:
        raise ValueError(f"backward_dq PACK {config['PACK']} must divide the group "
                         f"{num_q_heads // num_kv_heads} and BLOCK_M {config['BLOCK_M']}")
    k_arg, v_arg = _descriptors(config.pop("TMA", 0) and plain_head, (k_SGD, v_SGD), config["BLOCK_N"])
    _attention_bwd_dq_kernel[(num_tokens // (config["BLOCK_M"] // config["PACK"]) + num_seqs,
                              num_q_heads // config["PACK"])](
        q_TQD, k_SGD, v_SGD, grad_TQD, k_arg, v_arg, lse_TQ, delta_TQ, dq_TQD, cu_seqlens_q, cu_seqlens_k, num_seqs,
        scale, *strides, dq_TQD.stride(0), dq_TQD.stride(1), **common, USE_TMA=k_arg is not k_SGD, **config)
    return dq_TQD, dk_SGD, dv_SGD


def write_kv_cache(k_TGD: torch.Tensor, v_TGD: torch.Tensor, key_cache_PZGD: torch.Tensor,
                   value_cache_PZGD: torch.Tensor, slot_mapping_T: torch.Tensor) -> None:
    """key_cache[slot // Z, slot % Z] = k, value_cache likewise, for every token with slot >= 0 (in place;
    k [T, G, D], v [T, G, W], last dims contiguous everywhere). No host synchronisation, so it can be captured
    in a CUDA graph."""
    num_tokens, num_kv_heads, head_dim = k_TGD.shape
    value_dim = v_TGD.shape[2]
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        k_TGD, v_TGD, key_cache_PZGD, value_cache_PZGD, slot_mapping_T, k_TGD.stride(0), k_TGD.stride(1),
        v_TGD.stride(0), v_TGD.stride(1), key_cache_PZGD.stride(0), key_cache_PZGD.stride(1),
        key_cache_PZGD.stride(2), value_cache_PZGD.stride(0), value_cache_PZGD.stride(1), value_cache_PZGD.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, VALUE_DIM=value_dim, BLOCK_G=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=_block_d(head_dim), BLOCK_W=_block_d(value_dim), PAGE=key_cache_PZGD.shape[1], num_warps=1)
