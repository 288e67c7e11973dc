"""rl.testing: tiny random MoE causal LMs of each supported architecture (transformers 5.x configs, no
downloads), for tests and examples, like torch.testing.

    from rl.testing import tiny_model, save_tiny_checkpoint
    model = rl.wrap(tiny_model("qwen3_moe", seed=0))          # bf16, eval mode, random weights
    path = save_tiny_checkpoint("mixtral", "out/mixtral")     # safetensors + a word-level tokenizer

Sizes are chosen so that every path that matters runs in well under a second on a CPU, while
staying inside what vLLM's CPU backend accepts (head_dim 32 or 64, hidden a multiple of 32):

| arch      | hidden | heads q/kv | head_dim | experts | top-k | moe I | extras                              |
|-----------|--------|------------|----------|---------|-------|-------|-------------------------------------|
| qwen3_moe | 64     | 4 / 2      | 32       | 8       | 2     | 32    | per-head q/k norm, norm_topk_prob   |
| mixtral   | 64     | 4 / 2      | 32       | 8       | 2     | 32    | always renormalises                 |
| olmoe     | 64     | 2 / 2      | 32       | 8       | 4     | 32    | whole-projection q/k norm, no renorm |
| qwen2_moe | 64     | 2 / 2      | 32       | 8       | 4     | 32    | qkv bias, gated shared expert I=64  |
| glm4_moe  | 64     | 4 / 2      | 32       | 8       | 2     | 32    | see below                           |
| deepseek_v3 | 64   | 3 (MLA)    | see below | 8      | 2     | 32    | see below                           |

All: 2 layers, vocab 512, max_position_embeddings 512, default rope, untied embeddings.
glm4_moe: 3 layers (the first dense, I=64), rotary over half of each head (partial_rotary_factor 0.5), per-head
q/k norm, q/k/v biases, 2 groups of 4 experts (topk_group 1), routed_scaling_factor 2.5, a random
e_score_correction_bias, one shared expert.
deepseek_v3: 3 layers (the first dense, I=64), MLA with q_lora_rank 24, kv_lora_rank 20, qk_nope_head_dim 12,
qk_rope_head_dim 8 (interleaved rope), v_head_dim 10; YaRN rope (factor 4 over 128 original positions, mscale 1,
mscale_all_dim 0.8: a softmax scale and cos/sin factor other than 1); routing as glm4_moe's (topk_method
'noaux_tc', scoring_func 'sigmoid' as real checkpoints write them). `q_lora_rank=None` gives Moonlight's plain q_proj.
Any config field can be overridden: `tiny_config("qwen3_moe", num_hidden_layers=4)`.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from rl.models import SUPPORTED

ARCHITECTURES = SUPPORTED
"""Every architecture rl supports (rl.models.SUPPORTED) has a tiny model here."""

WHOLE_HEAD_ROTARY = tuple(arch for arch in ARCHITECTURES if arch not in ("glm4_moe", "deepseek_v3"))
"""The architectures whose transformers code rotates the whole head whatever partial_rotary_factor says (GLM-4.5
applies it)."""

_COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    hidden_act="silu",
    initializer_range=0.05,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    use_cache=False,
)

_PER_ARCH = {
    "qwen3_moe": dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=128,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[],
    ),
    "mixtral": dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=32,
        num_local_experts=8, num_experts_per_tok=2,
    ),
    # OLMoE's k_norm has (hidden // heads) * kv_heads features, so head_dim must be hidden // heads.
    # rms_norm_eps: OLMoE's own 1e-5, the one vLLM's OLMoE builds every norm with (rl/vllm/model_check.py).
    "olmoe": dict(
        rms_norm_eps=1e-5, num_attention_heads=2, num_key_value_heads=2, intermediate_size=32,
        num_experts=8, num_experts_per_tok=4, norm_topk_prob=False,
    ),
    "qwen2_moe": dict(
        num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
        num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, norm_topk_prob=False, qkv_bias=True,
        decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False,
    ),
    "glm4_moe": dict(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=64,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True,
    ),
    "deepseek_v3": dict(
        num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3, intermediate_size=64,
        q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        rope_interleave=True, topk_method="noaux_tc", scoring_func="sigmoid",
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128,
                             beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8),
    ),
}

_CONFIG_CLASS = {
    "qwen3_moe": "Qwen3MoeConfig",
    "mixtral": "MixtralConfig",
    "olmoe": "OlmoeConfig",
    "qwen2_moe": "Qwen2MoeConfig",
    "glm4_moe": "Glm4MoeConfig",
    "deepseek_v3": "DeepseekV3Config",
}
_MODEL_CLASS = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


def _check_arch(arch: str) -> None:
    if arch not in _PER_ARCH:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {ARCHITECTURES}")


def tiny_config(arch: str, **overrides):
    """A transformers config for a tiny `arch` model (see the module table); `overrides` replace fields."""
    import transformers

    _check_arch(arch)
    fields = copy.deepcopy({**_COMMON, **_PER_ARCH[arch], **overrides})  # a config may change its dicts in place
    config = getattr(transformers, _CONFIG_CLASS[arch])(**fields)
    config.architectures = [_MODEL_CLASS[arch]]
    return config


def tiny_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
               **overrides):
    """A randomly initialised `arch` causal LM in eval mode; the same seed (and device) gives the same weights.

    Weights are drawn in fp32 on `device` from a private generator (normal, std=initializer_range;
    norm weights around 1 so that norms are not the identity), then cast to `dtype` (rotary frequencies stay fp32).
    Overrides make bigger models too: `tiny_model("qwen3_moe", device="cuda", hidden_size=2048, ...)`.
    """
    import transformers

    config = tiny_config(arch, **overrides)
    with torch.device(device):
        model = getattr(transformers, _MODEL_CLASS[arch])(config)
    generator = torch.Generator(device=device).manual_seed(seed)
    std = config.initializer_range
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            values = torch.randn(parameter.shape, generator=generator, dtype=torch.float32, device=device)
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                values = 1.0 + 0.1 * values
            elif name.endswith(".bias"):
                values = 0.1 * values
            else:
                values = std * values
            parameter.copy_(values)
        for name, buffer in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):  # GLM-4.5: a bias that changes the choice of experts
                buffer.copy_(0.05 * torch.randn(buffer.shape, generator=generator, dtype=torch.float32,
                                                device=device))
    # the rotary tables stay fp32, as from_pretrained(dtype=...) leaves them (a cast to bf16 would round the
    # frequencies and move transformers' own outputs by tens of percent at a few thousand tokens)
    rotary_buffers = {name: buffer for name, buffer in model.named_buffers() if name.endswith("inv_freq")}
    model = model.to(dtype)
    for name, buffer in rotary_buffers.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner).register_buffer(leaf, buffer, persistent=False)
    model.eval()
    return model


def _write_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer with tokens 't0'...'t{V-1}' (t0 pad, t1 bos, t2 eos, t3 unk), split on spaces."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t3"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()

    def special(word: str) -> AddedToken:  # whole words only: "t2" must not split "t218" into "t2" "18"
        return AddedToken(word, single_word=True, special=True, normalized=False)

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=special("t0"), bos_token=special("t1"),
                                        eos_token=special("t2"), unk_token=special("t3"))
    tokenizer.save_pretrained(directory)


def save_tiny_checkpoint(arch: str, directory, seed: int = 0, device: str | torch.device = "cpu",
                         **overrides) -> Path:
    """Save `tiny_model(arch, seed, device=device, **overrides)` (bf16, safetensors) and a tiny tokenizer to
    `directory` (device="cuda" draws the weights of big random models on the GPU).

    The tokenizer maps the words 't0'...'t{V-1}' to ids 0...V-1 (offline, no downloads); when it cannot be
    built, only the model is saved and callers pass token ids (vLLM: skip_tokenizer_init=True).
    Returns the directory as a Path.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model = tiny_model(arch, seed=seed, device=device, **overrides)
    model.save_pretrained(directory, safe_serialization=True)
    try:
        _write_tokenizer(directory, model.config.vocab_size)
    except Exception as error:  # the tokenizer is a convenience; the checkpoint is usable without it
        (directory / "TOKENIZER_MISSING.json").write_text(json.dumps({"reason": repr(error)}))
    return directory
