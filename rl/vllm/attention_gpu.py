"""vLLM's attention on CUDA engines through mok: new keys and values written with mok.write_kv_cache,
attention with mok.paged_attention reading vLLM's paged cache in place, the trainer's bits.

The backend extends vLLM's Triton backend: its metadata builder (which keeps query offsets, key counts
and block tables in persistent device buffers, so full CUDA graphs replay with new values), its KV-cache
shape and its CUDA-graph support are kept; only the two methods that touch the data are mok's. Neither
reads a device value on the host, so the decode steps vLLM captures as full CUDA graphs run mok's
kernels on replay. It is registered for every decoder backend vLLM may select on CUDA
(vllm_internals.GPU_DECODER_BACKENDS). Every use of a vLLM internal goes through
rl/vllm/vllm_internals.py.

Shapes: docs/shapes.md.
"""
from __future__ import annotations

import torch

import mok
from mok import hooks
from mok.errors import UnsupportedError
from rl.vllm import vllm_internals
from rl.vllm.attention_base import MokAttentionBase

TritonAttentionBackend, TritonAttentionImpl = vllm_internals.gpu_attention_classes()

DECODE_MAX_QUERIES = 4
"""Steps whose sequences have at most this many new queries run mok's decode tiles (a GQA group's heads
packed into one tile); the bits do not depend on the choice (tests/mok/test_attention_gpu.py)."""


class MokPagedAttentionImpl(MokAttentionBase, TritonAttentionImpl):
    """Decoder self-attention through mok.paged_attention; the trace name is `layers.{i}.attention`
    (observe_only: vLLM's Triton kernels compute; rl/vllm/attention_base.py)."""

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        """key, value: [T, G, D]; slot_mapping: int64 [>= T] (page * Z + slot; negative: padding)."""
        if self.observe_only:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        key_cache_PZGD, value_cache_PZGD = vllm_internals.gpu_kv_cache_views(kv_cache)
        mok.write_kv_cache(key, value, key_cache_PZGD, value_cache_PZGD, slot_mapping[: key.shape[0]])

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata, output: torch.Tensor, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """query [T, Q, D] -> output [T, Q * D] or [T, Q, D] (written in place); keys read from the cache."""
        if output_scale is not None or output_block_scale is not None:
            raise UnsupportedError("mok vLLM hook: fused output quantization is not supported")
        if attn_metadata is None:  # profiling run
            return output.fill_(0)
        step = vllm_internals.gpu_attention_step(attn_metadata)
        num_tokens = step.num_tokens
        if self.observe_only:
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
            name = self._name(layer)
            if name is not None and hooks.observed():
                hooks.emit(name, output[:num_tokens].view(num_tokens, self.num_heads, self.head_size), "output")
            return output
        key_cache_PZGD, value_cache_PZGD = vllm_internals.gpu_kv_cache_views(kv_cache)
        q_TQD = query[:num_tokens].view(num_tokens, self.num_heads, self.head_size)
        out_TQD = mok.paged_attention(q_TQD, key_cache_PZGD, value_cache_PZGD, step.cu_seqlens_q, step.seq_lens_k,
                                      step.block_table_BP, self.scale,
                                      decode=step.max_query_len <= DECODE_MAX_QUERIES)
        name = self._name(layer)
        if name is not None and hooks.observed():
            hooks.emit(name, out_TQD, "output")
        output[:num_tokens].view(out_TQD.shape).copy_(out_TQD)
        return output


class MokPagedAttentionBackend(TritonAttentionBackend):
    """vLLM's Triton backend (metadata builder, KV-cache shape, CUDA-graph support) with mok's impl."""

    supported_kv_cache_dtypes = ["auto", "bfloat16", "float16"]

    @staticmethod
    def get_name() -> str:
        return "TRITON_ATTN"

    @staticmethod
    def get_impl_cls() -> type[MokPagedAttentionImpl]:
        return MokPagedAttentionImpl
