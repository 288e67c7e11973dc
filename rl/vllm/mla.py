"""Multi-head Latent Attention (DeepSeek-V3 family) in vLLM on mok: the trainer's weight-absorbed form
(rl/models/mla.py, docs/contracts.md) over vLLM's latent KV cache, for prefill, chunked prefill and decode alike.

vLLM's MLA layer projects, normalises and rotates with its own layers (mok's linears, RMSNorm and rotary through
the other overrides), writes [kv_c, k_pe] into the latent cache, then calls `MLAAttention.forward_impl`, which
the plugin patches (rl/vllm/vllm_internals_mla.py) to `forward` below for layers built with mok's impl (the
platform's: rl/vllm/mla_cpu.py on CPU engines, mla_gpu.py on CUDA, both a `MokMLAImplBase`): the query
absorbed through W_UK (rl.models.mla.absorb_query), mok.paged_attention over the cache viewed as one key head
[P, Z, 1, A + R] with the values its first A features, the output through W_UV (rl.models.mla.project_output).
`MokDeepseekScalingRotaryEmbedding` rotates with mok.rotary and the trainer's YaRN (rl.models.deepseek_v3).

Shapes: docs/shapes.md; A = kv_lora_rank, R = qk_rope_head_dim, M = qk_nope_head_dim, W = v_head_dim.
"""
from __future__ import annotations

import torch

import mok
from mok import hooks
from mok.errors import UnsupportedError
from rl import trace_names
from rl.models import mla
from rl.vllm import vllm_internals, vllm_internals_mla
from rl.vllm.dense import MokLinear
from rl.vllm.model_check import check_current_model
from rl.vllm.vllm_internals_mla import DeepseekScalingRotaryEmbedding, DeepSeekV2FusedQkvAProjLinear

DECODE_MAX_QUERIES = 4
"""Steps whose sequences have at most this many new queries run mok's decode tiles (the query heads packed into
one tile); the bits do not depend on the choice (tests/mok/test_attention_mla_gpu.py)."""


class MokMLAImplBase:
    """Mixed into the platform's MLA impl (rl/vllm/mla_cpu.py, mla_gpu.py), before its vLLM class: the model check
    and the cache dtypes mok reads (the attention is `forward` below, through the patched forward_impl)."""

    def __init__(self, *args, **kwargs):
        check_current_model()
        super().__init__(*args, **kwargs)
        if self.kv_cache_dtype not in ("auto", "bfloat16", "float16"):
            raise UnsupportedError(f"mok vLLM hook: a {self.kv_cache_dtype} MLA cache is not supported")


class MokMLABackendBase:
    """Mixed into the platform's MLA backend, before its vLLM class: mok's impl and step-carrying builder (class
    attributes of the platform's backend) and any head size (mok's attention takes them all)."""

    impl_cls: type
    builder_cls: type

    @classmethod
    def get_impl_cls(cls) -> type:
        return cls.impl_cls

    @classmethod
    def get_builder_cls(cls) -> type:
        return cls.builder_cls

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any


def forward(layer, q_TQD: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
            attn_metadata, output_TO: torch.Tensor) -> torch.Tensor:
    """q_TQD [T', Q, M + R] (rotated; T' >= T padded) -> output [T', Q * W], written in place from the cache
    [P, Z, A + R] (the step's keys already written)."""
    if attn_metadata is None:  # profiling run
        return output_TO.fill_(0)
    step = attn_metadata.mok_step
    num_tokens = step.num_tokens
    nope, value_dim, latent = layer.qk_nope_head_dim, layer.v_head_dim, layer.kv_lora_rank
    weight = layer.kv_b_proj.weight
    q_TQD = q_TQD[:num_tokens]
    q_latent_TQA = mla.absorb_query(q_TQD[..., :nope], weight, nope, value_dim)
    q_TQD = torch.cat([q_latent_TQA, q_TQD[..., nope:]], dim=-1)
    key_cache_PZ1D = kv_cache.unsqueeze(2)  # one key head: [kv_c, k_pe]
    out_TQA = mok.paged_attention(q_TQD, key_cache_PZ1D, key_cache_PZ1D[..., :latent], step.cu_seqlens_q,
                                  step.seq_lens_k, step.block_table_BP, float(layer.impl.scale),
                                  decode=step.max_query_len <= DECODE_MAX_QUERIES)
    name = trace_names.from_vllm_module(layer.layer_name)  # layers.{i}.attention, as the trainer's
    if name is not None and hooks.observed():
        hooks.emit(name, out_TQA, "output")
    output_TO[:num_tokens].copy_(mla.project_output(out_TQA, weight, nope, value_dim))
    return output_TO


class MokDeepseekScalingRotaryEmbedding(DeepseekScalingRotaryEmbedding):
    """DeepSeek's YaRN rotary through mok.rotary with the trainer's YarnScaling, read from the model's config by
    rl.models.deepseek_v3.yarn_scaling (the same function the trainer's adapter calls)."""

    def __init__(self, *args, **kwargs):
        check_current_model()
        super().__init__(*args, **kwargs)
        from rl.models.deepseek_v3 import yarn_scaling

        config = vllm_internals.current_vllm_config()
        self.mok_yarn = yarn_scaling(config.model_config.hf_config)

    def _rotate(self, positions_T: torch.Tensor, x_TO: torch.Tensor) -> torch.Tensor:
        x_TQD = x_TO.reshape(x_TO.shape[0], -1, self.rotary_dim)
        out_TQD = mok.rotary(x_TQD, positions_T.reshape(-1).to(torch.int64), float(self.base), self.rotary_dim,
                             bool(self.is_neox_style), yarn=self.mok_yarn)
        return out_TQD.reshape(x_TO.shape)

    def forward_native(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None,
                       offsets: torch.Tensor | None = None):
        if offsets is not None:
            raise UnsupportedError("mok vLLM hook: rotary offsets are not supported")
        return self._rotate(positions, query), (None if key is None else self._rotate(positions, key))

    forward_cpu = forward_native
    forward_cuda = forward_native


class MokDeepSeekV2FusedQkvAProjLinear(MokLinear, DeepSeekV2FusedQkvAProjLinear):
    """q_a_proj and kv_a_proj_with_mqa fused (q_lora_rank set) through mok.linear, as the other linears (vLLM
    0.26.0's custom GEMM for DeepSeek-V3's shape on CUDA, which would bypass the linear method, is turned off)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not self.observe_only:
            self._use_min_latency_gemm = False


def install_linear() -> None:
    """Register the fused q_a / kv_a projection (op 'linear'; vLLM plugs it by its own class name)."""
    vllm_internals.register_layer(DeepSeekV2FusedQkvAProjLinear, MokDeepSeekV2FusedQkvAProjLinear)


def install(backend: type, impl: type, names: tuple[str, ...]) -> None:
    """Register `backend` (the platform's: rl/vllm/mla_cpu.py or mla_gpu.py) for the MLA backend `names`, patch
    MLAAttention.forward_impl for layers built with `impl`, and replace DeepSeek's YaRN rotary."""
    vllm_internals_mla.register_mla_backend(f"{backend.__module__}.{backend.__qualname__}", names)
    vllm_internals_mla.patch_mla_forward(impl, forward)
    vllm_internals.register_layer(DeepseekScalingRotaryEmbedding, MokDeepseekScalingRotaryEmbedding)
