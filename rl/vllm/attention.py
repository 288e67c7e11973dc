"""A vLLM attention backend (registered as CPU_ATTN) that reads vLLM's paged KV cache into packed
per-sequence keys and values and runs mok.attention, the trainer's attention op.

Legend: T query tokens this step, B sequences, S packed keys (all sequences), Hq / Hkv heads,
D head_dim, N cache blocks, P block size (tokens per block).

vLLM's CPU KV cache per layer is [N, Hkv, P, 2 * D] bf16; viewed as [N, Hkv, 2P, D], rows 0..P-1 of a
block-head are keys and P..2P-1 values. This backend writes the new keys and values there itself
(plain indexed copies: exact) before the forward, as vLLM's backend does
(`forward_includes_kv_cache_update = False`), and reads them back the same way, so it does not
depend on the layout vLLM's C++ kernels use inside a block. vLLM's metadata builder is kept (its
scheduler metadata is unused here).
"""
from __future__ import annotations

import torch

import mok
from mok import hooks
from mok.errors import UnsupportedError
from rl.vllm.trace import layer_trace_name
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
)


def _split_cache(kv_cache_NHP2D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, Hkv, P, 2D] -> key and value views [N, Hkv, P, D] (no copies)."""
    num_blocks, num_kv_heads, block_size, _ = kv_cache_NHP2D.shape
    view = kv_cache_NHP2D.view(num_blocks, num_kv_heads, block_size * 2, -1)
    return view[:, :, :block_size], view[:, :, block_size:]


class MokAttentionImpl(CPUAttentionBackendImpl):
    """Decoder self-attention through mok.attention; the trace name is `layers.{i}.attention`.

    observe_only (set by overrides.install for MOK_VLLM_SKIP=attention with MOK_TRACE): vLLM's own
    kernels compute, and only the trace records.
    """

    observe_only = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.attn_type != AttentionType.DECODER:
            raise UnsupportedError(f"mok vLLM hook: attention type {self.attn_type} is not supported")
        for label, value in (("alibi", self.alibi_slopes), ("attention sinks", self.sinks)):
            if value is not None:
                raise UnsupportedError(f"mok vLLM hook: {label} is not supported")
        if self.sliding_window != -1 or self.logits_soft_cap:
            raise UnsupportedError("mok vLLM hook: sliding windows and soft caps are not supported")
        if self.is_fp8_kv_cache:
            raise UnsupportedError("mok vLLM hook: an fp8 KV cache is not supported")
        self._names: dict[int, str] = {}

    def _name(self, layer) -> str | None:
        if id(layer) not in self._names:
            self._names[id(layer)] = layer_trace_name(getattr(layer, "layer_name", ""), "attention")
        return self._names[id(layer)]

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        """key, value: [T, Hkv, D]; slot_mapping: [>= T] int64 slots (block * P + offset; < 0: skip)."""
        if self.observe_only:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        key_cache, value_cache = _split_cache(kv_cache)
        block_size = key_cache.shape[2]
        num_tokens = key.shape[0]
        slots_T = slot_mapping[:num_tokens].long()
        valid_T = slots_T >= 0
        blocks, offsets = slots_T[valid_T] // block_size, slots_T[valid_T] % block_size
        key_cache[blocks, :, offsets] = key[:num_tokens][valid_T].to(key_cache.dtype)
        value_cache[blocks, :, offsets] = value[:num_tokens][valid_T].to(value_cache.dtype)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: CPUAttentionMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None, output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """query [T, Hq, D] -> output [T, Hq * D] (written in place), keys read from the cache."""
        if output_scale is not None or output_block_scale is not None:
            raise UnsupportedError("mok vLLM hook: fused output quantization is not supported")
        if attn_metadata is None:  # profiling / warm-up
            return output
        if not attn_metadata.causal or attn_metadata.dynamic_causal is not None:
            raise UnsupportedError("mok vLLM hook: only causal decoder attention is supported")
        num_tokens = attn_metadata.num_actual_tokens
        if self.observe_only:
            name = self._name(layer)
            q_TQD = query[:num_tokens].reshape(num_tokens, self.num_heads, self.head_size)
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
            if name is not None and hooks.observed():
                hooks.emit(name, output[:num_tokens].reshape(q_TQD.shape), "output")
            return output
        key_cache, value_cache = _split_cache(kv_cache)
        num_kv_heads, block_size, head_dim = key_cache.shape[1], key_cache.shape[2], key_cache.shape[3]
        query_start_loc = attn_metadata.query_start_loc.tolist()
        seq_lens = attn_metadata.seq_lens.tolist()
        block_table = attn_metadata.block_table
        num_seqs = len(seq_lens)

        keys, values = [], []
        for b in range(num_seqs):
            seq_len = seq_lens[b]
            num_blocks = -(-seq_len // block_size)
            blocks = block_table[b, :num_blocks].long()
            # [nb, Hkv, P, D] -> [nb * P, Hkv, D] in key order, first seq_len rows.
            keys.append(key_cache[blocks].permute(0, 2, 1, 3).reshape(-1, num_kv_heads, head_dim)[:seq_len])
            values.append(value_cache[blocks].permute(0, 2, 1, 3).reshape(-1, num_kv_heads, head_dim)[:seq_len])
        k_SKD = torch.cat(keys) if keys else key_cache.new_empty(0, num_kv_heads, head_dim)
        v_SKD = torch.cat(values) if values else value_cache.new_empty(0, num_kv_heads, head_dim)
        cu_seqlens_k = torch.zeros(num_seqs + 1, dtype=torch.int32)
        cu_seqlens_k[1:] = torch.tensor(seq_lens, dtype=torch.int32).cumsum(0)
        cu_seqlens_q = torch.tensor(query_start_loc[: num_seqs + 1], dtype=torch.int32)
        q_TQD = query[:num_tokens].reshape(num_tokens, self.num_heads, self.head_size)
        out_TQD = mok.attention(q_TQD, k_SKD, v_SKD, cu_seqlens_q, cu_seqlens_k, self.scale, causal=True,
                                name=self._name(layer))
        output[:num_tokens].copy_(out_TQD.reshape(output[:num_tokens].shape))
        return output


class MokAttentionBackend(CPUAttentionBackend):
    """CPU_ATTN with mok's implementation (the same KV-cache shape and metadata builder)."""

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls() -> type[MokAttentionImpl]:
        return MokAttentionImpl
