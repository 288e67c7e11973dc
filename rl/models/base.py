"""What the decoder needs to know about one transformers MoE causal LM, read from its modules.

An adapter holds references to the model's own modules (never copies of their weights) and the few
numbers the ops need (heads, head_dim, eps, rope theta, top-k, renormalize). Parameters are read from
the modules at every forward, so `model.to(...)`, `load_state_dict` and optimiser steps are seen.

Shapes: docs/shapes.md.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from rl.errors import UnsupportedModelError

__all__ = ["CONFIG_FIELDS", "UnsupportedModelError", "check_config", "standard_adapter"]


QKNorm = Literal["none", "per_head", "whole"]
"""Where q/k RMSNorms sit: none; per head over D (Qwen3-MoE); over the whole projection (OLMoE)."""


@dataclass(frozen=True)
class Norm:
    """An RMSNorm module with `.weight` [dim] and an epsilon."""

    module: nn.Module
    eps: float

    @property
    def weight(self) -> torch.Tensor:
        return self.module.weight


@dataclass(frozen=True)
class Attention:
    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    o_proj: nn.Linear
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    qk_norm: QKNorm
    q_norm: Norm | None
    k_norm: Norm | None
    clip_qkv: float | None


@dataclass(frozen=True)
class DenseMLP:
    """SwiGLU MLP with separate gate/up/down projections (dense layers, shared experts)."""

    gate_proj: nn.Linear
    up_proj: nn.Linear
    down_proj: nn.Linear


@dataclass(frozen=True)
class GroupedRouting:
    """Group-limited sigmoid routing (GLM-4.5, DeepSeek-V3; mok.route_grouped) on fp32 router logits; the
    correction bias is read from `router.e_score_correction_bias` [E] at every forward."""

    n_group: int
    topk_group: int
    scaling: float  # routed_scaling_factor


@dataclass(frozen=True)
class SparseMoE:
    """Router gate weight [E, H] and fused experts: gate_up_proj w13 [E, 2I, H], down_proj w2 [E, H, I]."""

    router: nn.Module  # `.weight` [E, H]
    experts: nn.Module  # `.gate_up_proj` [E, 2I, H], `.down_proj` [E, H, I]
    top_k: int
    renormalize: bool
    shared_expert: DenseMLP | None = None
    shared_expert_gate: nn.Linear | None = None  # [1, H]; output scaled by sigmoid(gate(x)); None: added as is
    grouped: GroupedRouting | None = None  # None: mok.moe's own softmax top-k routing


@dataclass(frozen=True)
class Layer:
    input_norm: Norm
    attention: Attention
    post_attention_norm: Norm
    mlp: SparseMoE | DenseMLP


@dataclass(frozen=True)
class ModelAdapter:
    arch: str
    embed: nn.Embedding
    layers: tuple[Layer, ...]
    final_norm: Norm
    lm_head: nn.Linear
    rope_theta: float
    rotary_dim: int


@dataclass(frozen=True)
class Implemented:
    """The values of one config field that mok implements: `ok(value)`; `what` says which, for the error."""

    what: str
    ok: Callable[[object], bool]


_UNSET = object()


def _whole_head(partial_rotary_factor) -> bool:
    return partial_rotary_factor is None or partial_rotary_factor == 1.0


def _rope_type(value) -> str:
    if value is None:
        return "default"
    if not isinstance(value, dict):
        return repr(value)
    rope_type = value.get("rope_type", value.get("type", "default"))
    return rope_type if isinstance(rope_type, str) else repr(rope_type)


_NONE_WINDOW = Implemented("None (mok.attention is full causal attention: no sliding window)", lambda v: v is None)
_NO_DROPOUT = Implemented("0.0 (mok.attention has no dropout)", lambda v: not v)
_SILU = Implemented("'silu' (mok.silu_and_mul / mok.moe are SwiGLU only)", lambda v: v == "silu")
_DEFAULT_ROPE = Implemented(
    "rope_type 'default' over the whole head (mok.rotary is unscaled rotary only; these architectures' transformers "
    "code rotates every head dim whatever partial_rotary_factor says)",
    lambda v: _rope_type(v) == "default"
    and _whole_head(v.get("partial_rotary_factor") if isinstance(v, dict) else None))
_WHOLE_HEAD = Implemented(
    "1.0 (transformers' code of these architectures rotates the whole head and ignores the field)",
    lambda v: _whole_head(v))
_NO_ROUTER_LOGITS = Implemented(
    "False (the wrapped forward's loss has no router auxiliary loss; transformers adds one when True)",
    lambda v: not v)
_NO_JITTER = Implemented("0.0 (mok routing is deterministic: no router jitter noise)", lambda v: not v)
_FULL_ATTENTION = Implemented(
    "every layer 'full_attention' (mok.attention is full causal attention: no sliding window)",
    lambda v: v is None or all(t == "full_attention" for t in v))

_DEFAULT_OR_YARN_ROPE = Implemented(
    "rope_type 'default' or 'yarn' over the whole rope head (mok.rotary with mok.ops.rotary.YarnScaling; DeepSeek-V3 "
    "rotates its qk_rope_head_dim features)",
    # 'deepseek_yarn': vLLM's name for 'yarn' in its copy of the config (read again by the sampler's contract)
    lambda v: _rope_type(v) in ("default", "yarn", "deepseek_yarn")
    and _whole_head(v.get("partial_rotary_factor") if isinstance(v, dict) else None))
_DEFAULT_PARTIAL_ROPE = Implemented(
    "rope_type 'default' with a partial_rotary_factor in (0, 1] (mok.rotary is unscaled rotary; GLM-4.5's "
    "transformers code rotates the first head_dim * partial_rotary_factor features of each head)",
    lambda v: _rope_type(v) == "default" and _partial_factor_ok(v))


def _partial_factor_ok(value) -> bool:
    factor = value.get("partial_rotary_factor", 1.0) if isinstance(value, dict) else 1.0
    return isinstance(factor, (int, float)) and 0 < factor <= 1


_COMMON_FIELDS: dict[str, Implemented] = {
    "hidden_act": _SILU,
    "rope_parameters": _DEFAULT_ROPE,
    "rope_scaling": _DEFAULT_ROPE,  # transformers 4.x name of rope_parameters
    "partial_rotary_factor": _WHOLE_HEAD,
    "attention_dropout": _NO_DROPOUT,
    "output_router_logits": _NO_ROUTER_LOGITS,
}

CONFIG_FIELDS: dict[str, dict[str, Implemented]] = {
    # Implemented with any value (read by the adapters or the module layout, not listed): head_dim,
    # num_key_value_heads, norm_topk_prob, mlp_only_layers / decoder_sparse_step (dense layers),
    # attention_bias / qkv_bias (mok.linear takes the bias), clip_qkv (OLMoE), tie_word_embeddings
    # (lm_head's own weight is read, tied or not), the shared expert and its gate (Qwen2-MoE).
    # Training-only fields that the wrapped model never reads (router_aux_loss_coef,
    # initializer_range) change nothing. A field a config does not have counts as its default.
    "qwen3_moe": {
        **_COMMON_FIELDS,
        # Qwen3MoeConfig sets sliding_window None unless use_sliding_window; the model reads sliding_window.
        "sliding_window": _NONE_WINDOW,
    },
    "mixtral": {
        **_COMMON_FIELDS,
        "sliding_window": _NONE_WINDOW,  # MixtralConfig has no use_sliding_window: a set window is used
        "router_jitter_noise": _NO_JITTER,
    },
    "olmoe": {
        **_COMMON_FIELDS,
        "sliding_window": _NONE_WINDOW,  # not an OlmoeConfig field, but its attention reads it when set
    },
    "qwen2_moe": {
        **_COMMON_FIELDS,
        # Qwen2MoeConfig derives layer_types from use_sliding_window / sliding_window / max_window_layers;
        # the model reads layer_types (a 'sliding_attention' layer uses sliding_window).
        "layer_types": _FULL_ATTENTION,
        "use_sliding_window": Implemented("False (mok.attention is full causal attention: no sliding window)",
                                          lambda v: not v),
    },
    "glm4_moe": {
        **_COMMON_FIELDS,
        # Read by the adapter (rl/models/glm4_moe.py): partial_rotary_factor (in rope_parameters), use_qk_norm,
        # n_group / topk_group / routed_scaling_factor / e_score_correction_bias, n_shared_experts,
        # first_k_dense_replace. num_nextn_predict_layers builds no module of the forward. No sliding window.
        "rope_parameters": _DEFAULT_PARTIAL_ROPE,
        "rope_scaling": _DEFAULT_PARTIAL_ROPE,
        "partial_rotary_factor": Implemented("a factor in (0, 1] (the copy of rope_parameters' own)",
                                            lambda v: _partial_factor_ok({"partial_rotary_factor": v})),
        "output_router_logits": Implemented(
            "False (the wrapped forward returns no router logits; transformers returns them when True)",
            lambda v: not v),
    },
    "deepseek_v3": {
        **_COMMON_FIELDS,
        # Read by the adapter (rl/models/deepseek_v3.py): q_lora_rank (None or a rank), kv_lora_rank,
        # qk_nope_head_dim / qk_rope_head_dim / v_head_dim, rope_interleave, attention_bias (mok.linear takes the
        # biases), the yarn fields, n_group / topk_group / routed_scaling_factor / e_score_correction_bias,
        # n_shared_experts, first_k_dense_replace. num_nextn_predict_layers builds no module of the forward.
        "rope_parameters": _DEFAULT_OR_YARN_ROPE,
        "rope_scaling": _DEFAULT_OR_YARN_ROPE,
        "output_router_logits": Implemented(
            "False (the wrapped forward returns no router logits; transformers returns them when True)",
            lambda v: not v),
    },
}
"""model_type -> {config field: the values mok implements}. Fields here change the math (forward, or
the loss the wrapped forward returns) and mok implements only some of their values; `check_config`
refuses the others with UnsupportedModelError naming the field and its value."""


def check_config(arch: str, config) -> None:
    """Raise UnsupportedModelError for the first field of CONFIG_FIELDS[arch] whose value mok does not implement."""
    for field, implemented in CONFIG_FIELDS.get(arch, {}).items():
        value = getattr(config, field, _UNSET)
        if value is _UNSET:
            continue
        if not implemented.ok(value):
            fail(arch, f"config.{field}={value!r} is not supported; mok implements {implemented.what}")


def fail(arch: str, what: str) -> None:
    raise UnsupportedModelError(f"rl: {arch}: {what}")


def norm(arch: str, module: nn.Module, where: str) -> Norm:
    """An RMSNorm of the plain `weight * x / rms(x)` kind (transformers' *RMSNorm with `variance_epsilon`)."""
    eps = getattr(module, "variance_epsilon", None)
    if eps is None:
        eps = getattr(module, "eps", None)
    weight = getattr(module, "weight", None)
    if eps is None or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        fail(arch, f"{where} ({type(module).__name__}) is not an RMSNorm with a 1-D weight and an epsilon")
    if getattr(module, "bias", None) is not None:
        fail(arch, f"{where} ({type(module).__name__}) has a bias; mok.rms_norm has none")
    return Norm(module=module, eps=float(eps))


def linear(arch: str, module: nn.Module, where: str) -> nn.Linear:
    if not isinstance(module, nn.Linear):
        fail(arch, f"{where} is a {type(module).__name__}, not an nn.Linear")
    return module


def rope(arch: str, config) -> tuple[float, int]:
    """(theta, rotary_dim) of a default (unscaled) rotary embedding; other rope types are refused."""
    parameters = getattr(config, "rope_parameters", None) or {}
    rope_type = parameters.get("rope_type", "default")
    if rope_type != "default":
        fail(arch, f"rope_type {rope_type!r} is not supported by mok.rotary (only 'default')")
    theta = parameters.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        fail(arch, "config has no rope_theta")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return float(theta), int(head_dim)  # partial_rotary_factor: refused by CONFIG_FIELDS


def attention(arch: str, module: nn.Module, config, qk_norm: QKNorm, where: str) -> Attention:
    for field in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if not hasattr(module, field):
            fail(arch, f"{where} has no {field}")
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = int(module.head_dim)
    if getattr(module, "sliding_window", None) or (
        getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None)
    ):
        fail(arch, f"{where} uses a sliding window; mok.attention is full causal attention only")
    if getattr(config, "attention_dropout", 0.0):
        fail(arch, f"attention_dropout={config.attention_dropout}; mok.attention has no dropout")
    if num_heads % num_kv_heads:
        fail(arch, f"{num_heads} query heads are not a multiple of {num_kv_heads} key/value heads")
    q_norm = k_norm = None
    if qk_norm != "none":
        q_norm = norm(arch, module.q_norm, f"{where}.q_norm")
        k_norm = norm(arch, module.k_norm, f"{where}.k_norm")
    return Attention(
        q_proj=linear(arch, module.q_proj, f"{where}.q_proj"),
        k_proj=linear(arch, module.k_proj, f"{where}.k_proj"),
        v_proj=linear(arch, module.v_proj, f"{where}.v_proj"),
        o_proj=linear(arch, module.o_proj, f"{where}.o_proj"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        scale=float(module.scaling),
        qk_norm=qk_norm,
        q_norm=q_norm,
        k_norm=k_norm,
        clip_qkv=getattr(config, "clip_qkv", None),
    )


def dense_mlp(arch: str, module: nn.Module, where: str) -> DenseMLP:
    for field in ("gate_proj", "up_proj", "down_proj"):
        if not hasattr(module, field):
            fail(arch, f"{where} has no {field}")
    act = getattr(module, "config", None)
    if act is not None and getattr(act, "hidden_act", "silu") != "silu":
        fail(arch, f"{where} uses activation {act.hidden_act!r}; mok.silu_and_mul is SwiGLU only")
    return DenseMLP(
        gate_proj=linear(arch, module.gate_proj, f"{where}.gate_proj"),
        up_proj=linear(arch, module.up_proj, f"{where}.up_proj"),
        down_proj=linear(arch, module.down_proj, f"{where}.down_proj"),
    )


def sparse_moe(arch: str, block: nn.Module, renormalize: bool, where: str) -> SparseMoE:
    router = getattr(block, "gate", None)
    experts = getattr(block, "experts", None)
    if router is None or not isinstance(getattr(router, "weight", None), torch.Tensor):
        fail(arch, f"{where} has no router `gate` with a weight [E, H]")
    if getattr(router, "bias", None) is not None:
        fail(arch, f"{where}.gate has a bias; mok.route takes bias-free router logits")
    w13 = getattr(experts, "gate_up_proj", None)
    w2 = getattr(experts, "down_proj", None)
    if not isinstance(w13, torch.Tensor) or not isinstance(w2, torch.Tensor) or w13.dim() != 3 or w2.dim() != 3:
        fail(arch, f"{where}.experts does not store fused expert weights gate_up_proj [E, 2I, H] and "
                   "down_proj [E, H, I]")
    num_experts, two_i, hidden = w13.shape
    if w2.shape != (num_experts, hidden, two_i // 2) or router.weight.shape != (num_experts, hidden):
        fail(arch, f"{where}: expert/router weight shapes {tuple(w13.shape)}, {tuple(w2.shape)}, "
                   f"{tuple(router.weight.shape)} do not match [E, 2I, H], [E, H, I], [E, H]")
    if getattr(experts, "has_bias", False) or getattr(experts, "gate_up_proj_bias", None) is not None:
        fail(arch, f"{where}.experts have biases; mok.moe has none")
    if getattr(block, "jitter_noise", 0.0):
        fail(arch, f"{where} has router_jitter_noise={block.jitter_noise}; mok routing is deterministic")
    # transformers keeps top_k on the router, or (DeepSeek-V3 before 5.11) on the block
    top_k = int(getattr(router, "top_k", 0) or getattr(block, "top_k", 0) or 0)
    if top_k <= 0:
        fail(arch, f"{where} has no top_k (on its gate or itself)")
    return SparseMoE(router=router, experts=experts, top_k=top_k, renormalize=renormalize)


def check_decoder_layer(arch: str, layer: nn.Module, where: str) -> None:
    for field in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
        if not hasattr(layer, field):
            fail(arch, f"{where} has no {field}")


def causal_lm_parts(arch: str, model: nn.Module) -> tuple[nn.Module, nn.Embedding, nn.Linear]:
    """(decoder, embedding, lm_head) of a *ForCausalLM."""
    decoder = getattr(model, "model", None)
    if decoder is None or not hasattr(decoder, "layers") or not hasattr(decoder, "norm"):
        fail(arch, f"{type(model).__name__} is not a *ForCausalLM with .model.layers and .model.norm")
    embed = getattr(decoder, "embed_tokens", None)
    if not isinstance(embed, nn.Embedding):
        fail(arch, "model.model.embed_tokens is not an nn.Embedding")
    lm_head = linear(arch, getattr(model, "lm_head", None), "lm_head")
    if lm_head.bias is not None:
        fail(arch, "lm_head has a bias")
    return decoder, embed, lm_head


def standard_adapter(model: nn.Module, arch: str, qk_norm: QKNorm, renormalize: bool,
                     shared_expert: bool = False) -> ModelAdapter:
    """The adapter of a Llama-like MoE decoder: pre-norm attention + pre-norm (sparse or dense) MLP."""
    config = model.config
    check_config(arch, config)
    if getattr(config, "hidden_act", "silu") != "silu":
        fail(arch, f"hidden_act {config.hidden_act!r}; mok.silu_and_mul / mok.moe are SwiGLU only")
    decoder, embed, lm_head = causal_lm_parts(arch, model)
    theta, rotary_dim = rope(arch, config)
    layers = []
    for index, layer in enumerate(decoder.layers):
        where = f"layers.{index}"
        check_decoder_layer(arch, layer, where)
        if hasattr(layer.mlp, "experts"):
            mlp = sparse_moe(arch, layer.mlp, renormalize, f"{where}.mlp")
            if shared_expert:
                gate = getattr(layer.mlp, "shared_expert_gate", None)
                if gate is None or not hasattr(layer.mlp, "shared_expert"):
                    fail(arch, f"{where}.mlp has no shared_expert / shared_expert_gate")
                mlp = SparseMoE(
                    router=mlp.router, experts=mlp.experts, top_k=mlp.top_k, renormalize=mlp.renormalize,
                    shared_expert=dense_mlp(arch, layer.mlp.shared_expert, f"{where}.mlp.shared_expert"),
                    shared_expert_gate=linear(arch, gate, f"{where}.mlp.shared_expert_gate"),
                )
        else:
            mlp = dense_mlp(arch, layer.mlp, f"{where}.mlp")
        layers.append(Layer(
            input_norm=norm(arch, layer.input_layernorm, f"{where}.input_layernorm"),
            attention=attention(arch, layer.self_attn, config, qk_norm, f"{where}.self_attn"),
            post_attention_norm=norm(arch, layer.post_attention_layernorm, f"{where}.post_attention_layernorm"),
            mlp=mlp,
        ))
    if rotary_dim > layers[0].attention.head_dim or rotary_dim % 2:
        fail(arch, f"rotary_dim {rotary_dim} does not fit head_dim {layers[0].attention.head_dim}")
    return ModelAdapter(
        arch=arch,
        embed=embed,
        layers=tuple(layers),
        final_norm=norm(arch, decoder.norm, "model.norm"),
        lm_head=lm_head,
        rope_theta=theta,
        rotary_dim=rotary_dim,
    )
