"""A vLLM attention backend (registered as CPU_ATTN) that reads vLLM's paged KV cache into packed
per-sequence keys and values and runs mok.attention, the trainer's attention op.

vLLM's CPU KV cache per layer is [P, G, Z, 2 * D] bf16 (vllm_internals.split_kv_cache: each page-head
holds its key rows, then its value rows). This backend writes the new keys and values there itself
(plain indexed copies: exact) before the forward, as vLLM's backend does
(`forward_includes_kv_cache_update = False`), and reads them back the same way, so it does not
depend on the layout vLLM's C++ kernels use inside a page. vLLM's metadata builder is kept (its
scheduler metadata is unused here). Every use of a vLLM internal goes through rl/vllm/vllm_internals.py.

Shapes: docs/shapes.md.
"""
from __future__ import annotations

import torch

import mok
from mok import hooks
from mok.errors import UnsupportedError
from rl.vllm import vllm_internals
from rl.vllm.attention_base import MokAttentionBase

CPUAttentionBackend, CPUAttentionBackendImpl, CPUAttentionMetadata = vllm_internals.cpu_attention_classes()


class MokAttentionImpl(MokAttentionBase, CPUAttentionBackendImpl):
    """Decoder self-attention through mok.attention; the trace name is `layers.{i}.attention`
    (observe_only: rl/vllm/attention_base.py)."""

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        """key, value: [T, G, D]; slot_mapping: [>= T] int64 slots (page * Z + offset; < 0: skip)."""
        if self.observe_only:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        key_cache_PGZD, value_cache_PGZD = vllm_internals.split_kv_cache(kv_cache)
        page_size = key_cache_PGZD.shape[2]
        num_tokens = key.shape[0]
        slots_T = slot_mapping[:num_tokens].long()
        valid_T = slots_T >= 0
        pages, offsets = slots_T[valid_T] // page_size, slots_T[valid_T] % page_size
        key_cache_PGZD[pages, :, offsets] = key[:num_tokens][valid_T].to(key_cache_PGZD.dtype)
        value_cache_PGZD[pages, :, offsets] = value[:num_tokens][valid_T].to(value_cache_PGZD.dtype)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: CPUAttentionMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """query [T, Q, D] -> output [T, Q * D] (written in place), keys read from the cache."""
        if output_scale is not None or output_block_scale is not None:
            raise UnsupportedError("mok vLLM hook: fused output quantization is not supported")
        if attn_metadata is None:  # profiling / warm-up
            return output
        batch = vllm_internals.attention_batch(attn_metadata)
        num_tokens = batch.num_tokens
        q_TQD = query[:num_tokens].reshape(num_tokens, self.num_heads, self.head_size)
        if self.observe_only:
            name = self._name(layer)
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
            if name is not None and hooks.observed():
                hooks.emit(name, output[:num_tokens].reshape(q_TQD.shape), "output")
            return output
        key_cache_PGZD, value_cache_PGZD = vllm_internals.split_kv_cache(kv_cache)
        num_kv_heads, page_size, head_dim = key_cache_PGZD.shape[1:]
        keys, values = [], []
        for b, seq_len in enumerate(batch.seq_lens):
            num_pages = -(-seq_len // page_size)
            pages = batch.block_table_BP[b, :num_pages].long()
            # [pages, G, Z, D] -> [pages * Z, G, D] in key order, first seq_len rows.
            keys.append(key_cache_PGZD[pages].permute(0, 2, 1, 3).reshape(-1, num_kv_heads, head_dim)[:seq_len])
            values.append(value_cache_PGZD[pages].permute(0, 2, 1, 3).reshape(-1, num_kv_heads, head_dim)[:seq_len])
        k_SGD = torch.cat(keys) if keys else key_cache_PGZD.new_empty(0, num_kv_heads, head_dim)
        v_SGD = torch.cat(values) if values else value_cache_PGZD.new_empty(0, num_kv_heads, head_dim)
        cu_seqlens_k = torch.zeros(len(batch.seq_lens) + 1, dtype=torch.int32)
        cu_seqlens_k[1:] = torch.tensor(batch.seq_lens, dtype=torch.int32).cumsum(0)
        out_TQD = mok.attention(q_TQD, k_SGD, v_SGD, batch.cu_seqlens_q, cu_seqlens_k, self.scale, causal=True,
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
