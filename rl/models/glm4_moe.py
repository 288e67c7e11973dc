"""GLM-4.5 / 4.6 (transformers' Glm4MoeForCausalLM): GQA with q/k/v biases (`attention_bias`), optional per-head
q/k RMSNorm (`use_qk_norm`), neox-style rotary over the first head_dim * partial_rotary_factor features of each
head; dense SwiGLU MLPs in the first `first_k_dense_replace` layers, then routed experts chosen by group-limited
sigmoid routing (mok.route_grouped: e_score_correction_bias, n_group / topk_group, norm_topk_prob,
routed_scaling_factor) plus ungated shared experts added to their output."""
from __future__ import annotations

from torch import nn

from rl.models.base import (
    GroupedRouting,
    Layer,
    ModelAdapter,
    SparseMoE,
    attention,
    causal_lm_parts,
    check_config,
    check_decoder_layer,
    dense_mlp,
    fail,
    norm,
    rope,
    sparse_moe,
)

ARCH = "glm4_moe"


def _rotary_dim(config, head_dim: int) -> int:
    """head_dim * partial_rotary_factor, as transformers' Glm4MoeRotaryEmbedding sizes its inverse frequencies."""
    parameters = getattr(config, "rope_parameters", None) or {}
    factor = parameters.get("partial_rotary_factor", 1.0)
    top_level = getattr(config, "partial_rotary_factor", factor)
    if top_level != factor:  # transformers reads rope_parameters only; a differing copy means a confused config
        fail(ARCH, f"config.partial_rotary_factor={top_level!r} differs from rope_parameters' {factor!r}")
    rotary_dim = int(head_dim * factor)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        fail(ARCH, f"config.partial_rotary_factor={factor!r} (rope_parameters) gives rotary_dim {rotary_dim}; "
                   f"mok.rotary needs an even rotary_dim in (0, head_dim = {head_dim}]")
    return rotary_dim


def _check_groups(config, top_k: int, arch: str = ARCH) -> GroupedRouting:
    """The routing fields, refused by name where mok.route_grouped does not implement them (GLM-4.5 and the
    DeepSeek-V3 family share them)."""
    num_experts, n_group, topk_group = config.n_routed_experts, config.n_group, config.topk_group
    if not isinstance(n_group, int) or n_group < 1 or num_experts % n_group:
        fail(arch, f"config.n_group={n_group!r} is not supported; it must divide n_routed_experts={num_experts}")
    if not isinstance(topk_group, int) or not 1 <= topk_group <= n_group:
        fail(arch, f"config.topk_group={topk_group!r} is not supported; it must be in [1, n_group = {n_group}]")
    group_size = num_experts // n_group
    if topk_group < n_group and group_size < 2:  # a group is scored by its two best experts
        fail(arch, f"config.n_group={n_group!r} is not supported: groups of {group_size} expert(s), "
                   "mok.route_grouped scores a group by its two best experts")
    if top_k > topk_group * group_size:
        fail(arch, f"config.num_experts_per_tok={top_k!r} is not supported: more than the "
                   f"{topk_group * group_size} experts of the topk_group={topk_group} kept groups")
    return GroupedRouting(n_group=n_group, topk_group=topk_group, scaling=float(config.routed_scaling_factor))


def check_fields(config) -> None:
    """The config-only checks of build (rotary_dim, expert groups), also run by the vLLM plugin's model check."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    _rotary_dim(config, int(head_dim))
    _check_groups(config, int(config.num_experts_per_tok))


def moe_block(arch: str, block: nn.Module, config, where: str) -> SparseMoE:
    """A routed-experts block of grouped sigmoid routing with ungated shared experts (GLM-4.5, DeepSeek-V3)."""
    routed = sparse_moe(arch, block, bool(config.norm_topk_prob), where)
    if not hasattr(routed.router, "e_score_correction_bias"):
        fail(arch, f"{where}.gate has no e_score_correction_bias")
    shared = None
    if getattr(config, "n_shared_experts", None):  # 0 or None: transformers' shared MLP has width 0 (adds zeros)
        if not hasattr(block, "shared_experts"):
            fail(arch, f"{where} has no shared_experts")
        shared = dense_mlp(arch, block.shared_experts, f"{where}.shared_experts")
    return SparseMoE(router=routed.router, experts=routed.experts, top_k=routed.top_k,
                     renormalize=routed.renormalize, shared_expert=shared,
                     grouped=_check_groups(config, routed.top_k, arch))


def layers_of(arch: str, decoder: nn.Module, config, attention_of) -> tuple[Layer, ...]:
    """The decoder layers of GLM-4.5 and DeepSeek-V3: a dense MLP or a grouped-routing moe_block each;
    attention_of(self_attn module, where) builds the layer's attention."""
    layers = []
    for index, layer in enumerate(decoder.layers):
        where = f"layers.{index}"
        check_decoder_layer(arch, layer, where)
        if hasattr(layer.mlp, "experts"):
            mlp = moe_block(arch, layer.mlp, config, f"{where}.mlp")
        else:
            mlp = dense_mlp(arch, layer.mlp, f"{where}.mlp")
        layers.append(Layer(
            input_norm=norm(arch, layer.input_layernorm, f"{where}.input_layernorm"),
            attention=attention_of(layer.self_attn, f"{where}.self_attn"),
            post_attention_norm=norm(arch, layer.post_attention_layernorm, f"{where}.post_attention_layernorm"),
            mlp=mlp,
        ))
    if not layers:
        fail(arch, "the model has no decoder layers")
    return tuple(layers)


def build(model: nn.Module) -> ModelAdapter:
    config = model.config
    check_config(ARCH, config)
    check_fields(config)
    decoder, embed, lm_head = causal_lm_parts(ARCH, model)
    theta, _ = rope(ARCH, config)
    qk_norm = "per_head" if config.use_qk_norm else "none"
    layers = layers_of(ARCH, decoder, config, lambda module, where: attention(ARCH, module, config, qk_norm, where))
    return ModelAdapter(
        arch=ARCH,
        embed=embed,
        layers=layers,
        final_norm=norm(ARCH, decoder.norm, "model.norm"),
        lm_head=lm_head,
        rope_theta=theta,
        rotary_dim=_rotary_dim(config, layers[0].attention.head_dim),
    )
