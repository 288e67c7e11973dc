"""The plugin refuses, at engine start and before any weight loads, a model the sampler cannot compute as the
trainer does (rl/vllm/model_check.py): an architecture without a trainer adapter, a config value rl.wrap
refuses, or a value that vLLM's model code ignores while transformers' reads it. One line names it."""
from __future__ import annotations

import pytest
import transformers

from rl.errors import UnsupportedModelError
from rl.models import VLLM_SUPPORTED
from rl.testing import WHOLE_HEAD_ROTARY, tiny_config
from rl.vllm.model_check import check_model_config

pytestmark = pytest.mark.vllm

REFUSED = [
    ("olmoe", {"rms_norm_eps": 1e-6}, "rms_norm_eps=1e-06"),     # vLLM's OLMoE builds every norm with 1e-5
    ("olmoe", {"attention_bias": True}, "attention_bias=True"),  # vLLM's OLMoE has no q/k/v/o biases
    ("olmoe", {"clip_qkv": 8.0}, "clip_qkv=8.0"),                # vLLM's OLMoE does not clamp
    ("olmoe", {"norm_topk_prob": True}, "norm_topk_prob=True"),  # vLLM's OLMoE never renormalises
    ("qwen2_moe", {"qkv_bias": False}, "qkv_bias=False"),        # vLLM's Qwen2-MoE always has q/k/v biases
    ("qwen2_moe", {"head_dim": 64}, "head_dim=64"),              # vLLM takes hidden // heads
    ("qwen3_moe", {"attention_bias": True}, "attention_bias=True"),  # vLLM's o_proj has no bias
    ("mixtral", {"sliding_window": 16}, "sliding_window=16"),    # rl.wrap's own table (CONFIG_FIELDS)
    ("glm4_moe", {"n_shared_experts": 0}, "n_shared_experts=0"),  # vLLM would build a zero-width shared MLP
    ("glm4_moe", {"n_group": 3}, "n_group=3"),                    # rl.wrap's own checks (rl/models/glm4_moe.py)
    ("deepseek_v3", {"topk_method": "greedy"}, "topk_method='greedy'"),  # vLLM builds no correction bias then
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func='softmax'"),  # transformers scores with sigmoid
    ("deepseek_v3", {"moe_layer_freq": 2}, "moe_layer_freq=2"),  # vLLM makes every other layer dense
    ("deepseek_v3", {"rope_interleave": False}, "rope_interleave=False"),  # vLLM always rotates pairs
    ("deepseek_v3", {"attention_bias": True}, "attention_bias=True"),  # vLLM's MLA has no biases
    ("deepseek_v3", {"rms_norm_eps": 1e-5}, "rms_norm_eps=1e-05"),  # transformers' kv_a/q_a norms keep 1e-6
    ("deepseek_v3", {"n_group": 3}, "n_group=3"),  # rl.wrap's own checks (rl/models/deepseek_v3.py)
    *[(arch, {"partial_rotary_factor": 0.5}, "partial_rotary_factor")
      for arch in WHOLE_HEAD_ROTARY if arch in VLLM_SUPPORTED],
]


@pytest.mark.parametrize("arch, overrides, named", REFUSED, ids=[f"{a}-{n}" for a, _, n in REFUSED])
def test_refused_naming_architecture_field_and_value(arch, overrides, named):
    with pytest.raises(UnsupportedModelError, match=rf"mok vLLM hook: {arch}: config\..*{named}"):
        check_model_config(tiny_config(arch, **overrides))


@pytest.mark.parametrize("arch", VLLM_SUPPORTED)
def test_the_real_models_own_values_pass(arch):
    check_model_config(tiny_config(arch))


def test_deepseek_v3_without_the_routing_fields_vllm_reads_is_refused():
    """A DeepSeek-V3 config lacking topk_method: vLLM's model then builds no correction bias (transformers has one)."""
    config = tiny_config("deepseek_v3")
    del config.topk_method
    with pytest.raises(UnsupportedModelError, match="deepseek_v3: config.topk_method=None"):
        check_model_config(config)


def test_an_architecture_without_a_trainer_adapter_is_refused():
    with pytest.raises(UnsupportedModelError, match="model_type 'llama' is not supported"):
        check_model_config(transformers.LlamaConfig(num_hidden_layers=1))


def test_engine_start_is_refused_before_weights_load(tmp_path, capfd, restored_vllm):
    """A real engine: its start fails and the engine's log carries the one-line reason."""
    from rl.testing import save_tiny_checkpoint
    from rl.vllm.testing import environment, start_engine

    checkpoint = save_tiny_checkpoint("olmoe", tmp_path / "model", rms_norm_eps=1e-6)
    with environment(MOK_VLLM="1", MOK_VLLM_OPS=None, MOK_VLLM_SKIP=None, MOK_TRACE=None):
        with pytest.raises(Exception):  # noqa: B017 (vLLM wraps the engine process's error in its own)
            start_engine(checkpoint)
    captured = capfd.readouterr()
    log = captured.out + captured.err
    assert "UnsupportedModelError: mok vLLM hook: olmoe: config.rms_norm_eps=1e-06 is not supported" in log
    assert "Loading weights" not in log and "Loading safetensors" not in log


def test_vllms_v2_model_runner_is_refused_at_model_build(monkeypatch):
    """vLLM 0.26's V2 GPU model runner takes log-probabilities in its own kernel (docs/vllm.md); the plugin
    defaults it off (tests/vllm/test_plugin.py) and refuses it when a user turns it on."""
    from types import SimpleNamespace

    from rl.vllm import model_check, vllm_internals

    vllm_config = SimpleNamespace(model_config=SimpleNamespace(hf_config=tiny_config("qwen2_moe"), use_mla=False),
                                  use_v2_model_runner=True)
    monkeypatch.setattr(vllm_internals, "current_vllm_config", lambda: vllm_config)
    with pytest.raises(UnsupportedModelError, match="VLLM_USE_V2_MODEL_RUNNER=1"):
        model_check.check_current_model()
    vllm_config.use_v2_model_runner = False
    model_check.check_current_model()


def _engine(**settings):
    """A vLLM config as check_current_model reads it: a bf16 Qwen3-MoE, every setting at its default but those
    given (model_config's, or parallel_config / cache_config / lora_config / speculative_config)."""
    from types import SimpleNamespace

    import torch

    model = dict(hf_config=tiny_config("qwen3_moe"), use_mla=False, quantization=None, dtype=torch.bfloat16,
                 logprobs_mode="raw_logprobs", model_impl="auto")
    model.update({k: v for k, v in settings.items() if k in model})
    parallel = SimpleNamespace(tensor_parallel_size=settings.get("tensor_parallel_size", 1))
    return SimpleNamespace(model_config=SimpleNamespace(**model), use_v2_model_runner=False, parallel_config=parallel,
                           cache_config=SimpleNamespace(cache_dtype=settings.get("cache_dtype", "auto")),
                           lora_config=settings.get("lora_config"),
                           speculative_config=settings.get("speculative_config"))


ENGINE_REFUSED = [
    (dict(quantization="fp8"), "quantization='fp8'"),
    (dict(model_impl="transformers"), "model_impl='transformers'"),
    (dict(tensor_parallel_size=2), "tensor_parallel_size=2"),
    (dict(lora_config=object()), "enable_lora"),
    (dict(speculative_config=object(), logprobs_mode="processed_logprobs"), "speculative_config with logprobs_mode"),
    (dict(cache_dtype="float16"), "kv_cache_dtype='float16'"),
    (dict(cache_dtype="fp8_e4m3"), "kv_cache_dtype='fp8_e4m3'"),
]


@pytest.mark.parametrize("settings, named", ENGINE_REFUSED, ids=[n for _, n in ENGINE_REFUSED])
def test_engine_settings_the_sampler_cannot_agree_under_are_refused(monkeypatch, settings, named):
    from rl.vllm import model_check, vllm_internals

    monkeypatch.setattr(vllm_internals, "current_vllm_config", lambda: _engine(**settings))
    with pytest.raises(UnsupportedModelError, match=f"mok vLLM hook: {named}".replace("(", r"\(")):
        model_check.check_current_model()


@pytest.mark.parametrize("settings", [dict(), dict(cache_dtype="bfloat16"), dict(speculative_config=object()),
                                      dict(logprobs_mode="processed_logprobs")])
def test_engine_settings_that_agree_pass(monkeypatch, settings):
    from rl.vllm import model_check, vllm_internals

    monkeypatch.setattr(vllm_internals, "current_vllm_config", lambda: _engine(**settings))
    model_check.check_current_model()


def test_a_kv_cache_of_another_dtype_is_refused_before_weights_load(tmp_path, capfd, restored_vllm):
    import os

    from vllm import LLM

    from rl.testing import save_tiny_checkpoint
    from rl.vllm.testing import environment

    checkpoint = save_tiny_checkpoint("qwen3_moe", tmp_path / "model")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with environment(MOK_VLLM="1", MOK_VLLM_OPS=None, MOK_VLLM_SKIP=None, MOK_TRACE=None):
        with pytest.raises(Exception):  # noqa: B017 (vLLM wraps the engine process's error in its own)
            LLM(model=str(checkpoint), enforce_eager=True, gpu_memory_utilization=0.1, dtype="bfloat16",
                kv_cache_dtype="float16", skip_tokenizer_init=True, max_model_len=128)
    log = "".join(capfd.readouterr())
    assert "mok vLLM hook: kv_cache_dtype='float16'" in log
    assert "Loading weights" not in log and "Loading safetensors" not in log
