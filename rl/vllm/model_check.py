"""The model check the plugin runs in vLLM's engine process while the model is built, before any weight loads.

The trainer computes what transformers' model code computes; the sampler computes what vLLM's model code
computes with mok's ops. They agree only where both model codes read the config the same way, so a config is
refused, in one line naming the architecture, the field and its value, when
- its `model_type` has no trainer adapter or no sampler side yet (rl.models.VLLM_SUPPORTED);
- a field has a value mok does not implement (rl.models.base.CONFIG_FIELDS, the table rl.wrap checks);
- a field has a value that vLLM's model code ignores or overrides while transformers' reads it
  (VLLM_MODEL_FIELDS below: read from vLLM 0.26.0's and 0.32.0's model sources, which agree on each).

Called from the constructors of mok's vLLM layers (rl/vllm/dense.py, moe.py): the first one built checks
the model's config, the others find it checked.
"""
from __future__ import annotations

import weakref

from rl.errors import UnsupportedModelError
from rl.models import SUPPORTED, VLLM_SUPPORTED
from rl.models.base import Implemented, check_config

_UNSET = object()

# Why each entry: vLLM's model code at the named line does not do what transformers' does with the field.
_OLMOE_EPS = Implemented("1e-05 (vLLM's OLMoE builds every RMSNorm with eps=1e-5 and ignores the field)",
                         lambda v: v == 1e-5)
_NO_ATTENTION_BIAS = Implemented("False (vLLM's model builds its attention projections without biases)",
                                 lambda v: not v)
_NO_CLIP_QKV = Implemented("None (vLLM's OLMoE does not clamp q, k and v)", lambda v: v is None)
_QKV_BIAS = Implemented("True (vLLM's Qwen2-MoE always builds q/k/v biases)", lambda v: bool(v))
_NO_O_PROJ_BIAS = Implemented("False (vLLM's Qwen3-MoE builds o_proj without a bias; transformers adds one)",
                              lambda v: not v)


def _head_dim_is_hidden_over_heads(config, value) -> bool:
    return value is None or value == config.hidden_size // config.num_attention_heads


VLLM_MODEL_FIELDS: dict[str, dict[str, Implemented]] = {
    "qwen3_moe": {"attention_bias": _NO_O_PROJ_BIAS},
    # olmoe.py builds its FusedMoE with renormalize=False whatever the config says (transformers reads it)
    "olmoe": {"rms_norm_eps": _OLMOE_EPS, "attention_bias": _NO_ATTENTION_BIAS, "clip_qkv": _NO_CLIP_QKV,
              "norm_topk_prob": Implemented("False (vLLM's OLMoE never renormalises the top-k weights)",
                                            lambda v: not v)},
    "qwen2_moe": {"qkv_bias": _QKV_BIAS},
    # glm4_moe.py builds a shared MLP for any n_shared_experts that is not None; a zero-width one is not run here.
    "glm4_moe": {"n_shared_experts": Implemented("an integer >= 1", lambda v: isinstance(v, int) and v >= 1)},
    # deepseek_v2.py: the gate's correction bias only with topk_method 'noaux_tc' and sigmoid scores only with
    # scoring_func 'sigmoid' (transformers always has both); MoE layers also need i % moe_layer_freq == 0; the
    # rope always interleaved (is_neox_style=False); no attention biases; kv_a/q_a norms with rms_norm_eps
    # (transformers builds them with 1e-6); shared experts only for an n_shared_experts that is not None.
    "deepseek_v3": {
        "topk_method": Implemented("'noaux_tc'", lambda v: v == "noaux_tc"),
        "scoring_func": Implemented("'sigmoid'", lambda v: v == "sigmoid"),
        "moe_layer_freq": Implemented("1", lambda v: v == 1),
        "rope_interleave": Implemented("True (vLLM's DeepSeek rotates interleaved pairs)", lambda v: v is not False),
        "attention_bias": _NO_ATTENTION_BIAS,
        "rms_norm_eps": Implemented("1e-06 (transformers' kv_a/q_a norms use 1e-6, vLLM's the field)",
                                    lambda v: v == 1e-6),
        "n_shared_experts": Implemented("an integer >= 1", lambda v: isinstance(v, int) and v >= 1),
    },
}
"""model_type -> {config field: the values on which vLLM's model code and transformers' agree}."""

_ABSENT_VALUES = {("deepseek_v3", "topk_method"): None, ("deepseek_v3", "scoring_func"): "softmax"}
"""What vLLM's model code takes for a field a config does not have, where that is a value checked above."""

HEAD_DIM_FROM_HIDDEN = ("olmoe", "qwen2_moe")
"""Architectures whose vLLM model code takes head_dim = hidden_size // num_attention_heads (a config's own
`head_dim` is ignored there and read by transformers)."""

MLA_ARCHITECTURES = ("deepseek_v3",)
"""Architectures vLLM builds with Multi-head Latent Attention (rl/vllm/mla.py): vLLM's MLA must be on."""

_checked: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> a config checked in this process


def check_model_config(hf_config) -> None:
    """Raise UnsupportedModelError naming the first architecture, field or value of `hf_config` (transformers
    config of the model vLLM builds) that the sampler cannot compute as rl's trainer does."""
    arch = getattr(hf_config, "model_type", None)
    if arch not in VLLM_SUPPORTED:
        why = "rl.wrap supports it, the vLLM plugin does not yet; " if arch in SUPPORTED else ""
        raise UnsupportedModelError(f"mok vLLM hook: model_type {arch!r} is not supported "
                                    f"({why}supported: {', '.join(VLLM_SUPPORTED)})")
    try:
        check_config(arch, hf_config)
        if arch == "glm4_moe":  # its rotary_dim and expert groups, which rl.wrap checks beyond CONFIG_FIELDS
            from rl.models.glm4_moe import check_fields

            check_fields(hf_config)
        if arch == "deepseek_v3":  # its MLA, YaRN and expert groups
            from rl.models.deepseek_v3 import check_fields as check_deepseek_fields

            check_deepseek_fields(hf_config)
    except UnsupportedModelError as error:
        raise UnsupportedModelError(f"mok vLLM hook: {str(error).removeprefix('rl: ')}") from None
    for field, implemented in VLLM_MODEL_FIELDS.get(arch, {}).items():
        value = getattr(hf_config, field, _ABSENT_VALUES.get((arch, field), _UNSET))
        if value is not _UNSET and not implemented.ok(value):
            raise UnsupportedModelError(f"mok vLLM hook: {arch}: config.{field}={value!r} is not supported; "
                                        f"the sampler and the trainer agree only on {implemented.what}")
    if arch in HEAD_DIM_FROM_HIDDEN:
        value = getattr(hf_config, "head_dim", None)
        if not _head_dim_is_hidden_over_heads(hf_config, value):
            raise UnsupportedModelError(
                f"mok vLLM hook: {arch}: config.head_dim={value!r} is not supported; vLLM's model takes "
                f"hidden_size // num_attention_heads = {hf_config.hidden_size // hf_config.num_attention_heads}")


def check_current_model() -> None:
    """check_model_config on the model vLLM is building in this process (once per config); nothing outside
    a model build."""
    from rl.vllm import vllm_internals

    vllm_config = vllm_internals.current_vllm_config()
    hf_config = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
    if hf_config is None or _checked.get(id(hf_config)) is hf_config:
        return
    problem = engine_setting_problem(vllm_config)
    if problem is not None:
        raise UnsupportedModelError(f"mok vLLM hook: {problem}")
    check_model_config(hf_config)
    if getattr(vllm_config, "use_v2_model_runner", False):
        raise UnsupportedModelError(
            "mok vLLM hook: vLLM's V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1, or a feature that needs it) computes "
            "log-probabilities in its own kernel, not mok's; unset VLLM_USE_V2_MODEL_RUNNER or set it to 0")
    if getattr(hf_config, "model_type", None) in MLA_ARCHITECTURES:
        if not getattr(vllm_config.model_config, "use_mla", False):
            raise UnsupportedModelError(
                f"mok vLLM hook: {hf_config.model_type}: vLLM's MLA is off (VLLM_MLA_DISABLE?): "
                "the trainer computes MLA's absorbed form, the sampler only runs it as MLA")
    _checked[id(hf_config)] = hf_config


def engine_setting_problem(vllm_config) -> str | None:
    """An engine setting under which the sampler cannot compute what rl's trainer does, named, or None."""
    model_config = vllm_config.model_config
    impl = getattr(model_config, "model_impl", "auto")
    impl = getattr(impl, "value", impl)
    if impl not in ("auto", "vllm"):
        return (f"model_impl={impl!r}: the plugin replaces the layers of vLLM's own model code; another "
                "implementation runs other ops")
    if getattr(model_config, "quantization", None) is not None:
        return (f"quantization={model_config.quantization!r}: mok's ops read unquantized weights (layers whose "
                "quantized method it does not replace would run vLLM's own kernels)")
    parallel = getattr(vllm_config, "parallel_config", None)
    if getattr(parallel, "tensor_parallel_size", 1) > 1:
        return (f"tensor_parallel_size={parallel.tensor_parallel_size}: tensor parallelism splits the linears' sums "
                "(data and expert parallelism are supported)")
    if getattr(vllm_config, "lora_config", None) is not None:
        return "enable_lora: LoRA adapters are not applied by mok's ops"
    mode = getattr(model_config, "logprobs_mode", "raw_logprobs")
    mode = getattr(mode, "value", mode)
    if getattr(vllm_config, "speculative_config", None) is not None and str(mode).startswith("processed"):
        return (f"speculative_config with logprobs_mode={mode!r}: vLLM's rejection sampler reports other "
                "log-probabilities than its sampler in that mode (raw_logprobs agrees)")
    cache_dtype = getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto")
    model_dtype = str(getattr(model_config, "dtype", "")).removeprefix("torch.")
    if cache_dtype not in ("auto", model_dtype):
        return (f"kv_cache_dtype={cache_dtype!r}: the KV cache must hold the model's dtype ({model_dtype}; 'auto'), "
                "as the trainer's attention reads k and v unrounded")
    return None
