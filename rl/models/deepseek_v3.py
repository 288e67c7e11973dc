"""DeepSeek-V3 family (transformers' DeepseekV3ForCausalLM: DeepSeek-V3/R1, Kimi-K2, Moonlight-16B-A3B):
Multi-head Latent Attention in its weight-absorbed form (rl/models/mla.py), with q LoRA (q_a_proj, q_a_layernorm,
q_b_proj) or a plain q_proj (q_lora_rank None, as Moonlight and DeepSeek-V2-Lite), rope over qk_rope_head_dim
(interleaved pairs with rope_interleave, halves without), 'default' or 'yarn' rope scaling (mscale_all_dim in the
softmax scale, as transformers' module computes it); dense SwiGLU MLPs in the first `first_k_dense_replace` layers,
then routed experts chosen by group-limited sigmoid routing (mok.route_grouped) plus ungated shared experts."""
from __future__ import annotations

from torch import nn

from mok.ops.rotary import YarnScaling
from rl.models.base import (
    ModelAdapter,
    causal_lm_parts,
    check_config,
    fail,
    linear,
    norm,
)
from rl.models.glm4_moe import _check_groups, layers_of
from rl.models.mla import MLAttention

ARCH = "deepseek_v3"


def rope_parameters(config) -> dict:
    parameters = getattr(config, "rope_parameters", None) or {}
    return parameters if isinstance(parameters, dict) else {}


def yarn_scaling(config) -> YarnScaling | None:
    """YaRN of the rope dims as transformers' _compute_yarn_parameters reads rope_parameters (vLLM renames the
    rope_type 'deepseek_yarn' in its copy of the config); None for the default rope."""
    parameters = rope_parameters(config)
    if parameters.get("rope_type", "default") == "default":
        return None
    factor = parameters.get("factor")
    original = parameters["original_max_position_embeddings"]
    if factor is None:
        factor = config.max_position_embeddings / original
    attention_factor = parameters.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = parameters.get("mscale"), parameters.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
        else:
            attention_factor = _mscale(factor)
    return YarnScaling(float(factor), int(original), float(parameters.get("beta_fast") or 32),
                       float(parameters.get("beta_slow") or 1), float(attention_factor))


def _mscale(scale: float, mscale: float = 1.0) -> float:
    import math

    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def check_fields(config) -> None:
    """The config-only checks of build beyond CONFIG_FIELDS (also for the vLLM plugin's model check)."""
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
    if kv_heads not in (None, heads):  # transformers would repeat MLA's per-head keys again
        fail(ARCH, f"config.num_key_value_heads={kv_heads!r} is not supported; MLA needs it equal to "
                   f"num_attention_heads={heads}")
    if config.qk_rope_head_dim % 2 or config.qk_rope_head_dim <= 0:
        fail(ARCH, f"config.qk_rope_head_dim={config.qk_rope_head_dim!r} is not supported; mok.rotary needs an even "
                   "rotary dim > 0")
    _check_groups(config, int(config.num_experts_per_tok), ARCH)
    yarn = yarn_scaling(config)
    if yarn is not None and rope_parameters(config).get("truncate", True) is False:
        fail(ARCH, "config.rope_parameters truncate=False is not supported; mok's YaRN floors and ceils the "
                   "correction range (truncate=True, vLLM's formula)")


def _attention(module: nn.Module, config, where: str) -> MLAttention:
    if getattr(config, "attention_dropout", 0.0):
        fail(ARCH, f"attention_dropout={config.attention_dropout}; mok.attention has no dropout")
    low_rank_q = getattr(module, "q_lora_rank", None) is not None
    parameters = rope_parameters(config)
    return MLAttention(
        q_proj=None if low_rank_q else linear(ARCH, module.q_proj, f"{where}.q_proj"),
        q_a_proj=linear(ARCH, module.q_a_proj, f"{where}.q_a_proj") if low_rank_q else None,
        q_a_norm=norm(ARCH, module.q_a_layernorm, f"{where}.q_a_layernorm") if low_rank_q else None,
        q_b_proj=linear(ARCH, module.q_b_proj, f"{where}.q_b_proj") if low_rank_q else None,
        kv_a_proj=linear(ARCH, module.kv_a_proj_with_mqa, f"{where}.kv_a_proj_with_mqa"),
        kv_a_norm=norm(ARCH, module.kv_a_layernorm, f"{where}.kv_a_layernorm"),
        kv_b_proj=linear(ARCH, module.kv_b_proj, f"{where}.kv_b_proj"),
        o_proj=linear(ARCH, module.o_proj, f"{where}.o_proj"),
        num_heads=int(config.num_attention_heads),
        nope_dim=int(module.qk_nope_head_dim),
        rope_dim=int(module.qk_rope_head_dim),
        value_dim=int(module.v_head_dim),
        latent_dim=int(module.kv_lora_rank),
        scale=float(module.scaling),  # transformers' qk_head_dim ** -0.5 with yarn_apply_mscale
        rope_theta=float(parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
        neox_style=not getattr(config, "rope_interleave", True),
        yarn=yarn_scaling(config),
        max_positions=int(config.max_position_embeddings),
    )


def build(model: nn.Module) -> ModelAdapter:
    config = model.config
    check_config(ARCH, config)
    check_fields(config)
    decoder, embed, lm_head = causal_lm_parts(ARCH, model)
    layers = layers_of(ARCH, decoder, config, lambda module, where: _attention(module, config, where))
    attention = layers[0].attention
    return ModelAdapter(arch=ARCH, embed=embed, layers=layers, final_norm=norm(ARCH, decoder.norm, "model.norm"),
                        lm_head=lm_head, rope_theta=attention.rope_theta, rotary_dim=attention.rope_dim)
