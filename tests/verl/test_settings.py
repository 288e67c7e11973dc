"""What rl.verl refuses before anything starts, on verl's real hydra config (verl/trainer/config/ppo_trainer.yaml
composed with overrides, as `python -m verl.trainer.main_ppo` composes it) and verl's real engine configs; the
configured contracts; what `configure` sets; and the engine's place in verl's EngineRegistry."""
from __future__ import annotations

import json
import os

import pytest
import torch

import rl
from mok.errors import UnsupportedError
from rl.verl import check_config, configure, configured_contracts

REQUIRED = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.ref.strategy=fsdp2"]
"""The settings rl.verl needs that verl's defaults do not have (see the README's verl section)."""


def _config(checkpoint, *overrides: str):
    from hydra import compose, initialize_config_dir
    from verl.trainer import main_ppo

    config_dir = os.path.join(os.path.dirname(main_ppo.__file__), "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose("ppo_trainer", overrides=[f"actor_rollout_ref.model.path={checkpoint}", *REQUIRED,
                                                  *overrides])


def test_the_required_settings_pass_and_verls_defaults_are_refused_by_name(checkpoint):
    check_config(_config(checkpoint))
    with pytest.raises(UnsupportedError, match=r"actor_rollout_ref\.rollout\.tensor_model_parallel_size=2"):
        check_config(_config(checkpoint, "actor_rollout_ref.rollout.tensor_model_parallel_size=2"))


@pytest.mark.parametrize(("override", "named"), [
    ("actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.name='sglang'"),
    ("actor_rollout_ref.rollout.top_p=0.9", "actor_rollout_ref.rollout.top_p=0.9"),
    ("actor_rollout_ref.rollout.top_k=20", "actor_rollout_ref.rollout.top_k=20"),
    ("+actor_rollout_ref.rollout.repetition_penalty=1.1", "actor_rollout_ref.rollout.repetition_penalty=1.1"),
    ("actor_rollout_ref.rollout.do_sample=false", "actor_rollout_ref.rollout.do_sample=False"),
    ("actor_rollout_ref.rollout.temperature=0.0", "actor_rollout_ref.rollout.temperature=0.0"),
    ("actor_rollout_ref.rollout.logprobs_mode=raw_logprobs", "actor_rollout_ref.rollout.logprobs_mode='raw_logprobs'"),
    ("actor_rollout_ref.rollout.pipeline_model_parallel_size=2",
     "actor_rollout_ref.rollout.pipeline_model_parallel_size=2"),
    ("actor_rollout_ref.actor.strategy=fsdp", "actor_rollout_ref.actor.strategy='fsdp'"),
    ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
     "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"),
    ("actor_rollout_ref.model.use_fused_kernels=true", "actor_rollout_ref.model.use_fused_kernels=True"),
    ("actor_rollout_ref.model.use_liger=true", "actor_rollout_ref.model.use_liger=True"),
    ("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_rank=8"),
    ("actor_rollout_ref.actor.calculate_sum_pi_squared=true", "actor_rollout_ref.actor.calculate_sum_pi_squared=True"),
    ("actor_rollout_ref.rollout.temperature=inf", "actor_rollout_ref.rollout.temperature=inf"),
    ("+actor_rollout_ref.rollout.engine_kwargs.vllm.model_impl=transformers",
     "actor_rollout_ref.rollout.engine_kwargs.vllm.model_impl='transformers'"),
    ("+actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_dtype=fp8",
     "actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_dtype='fp8'"),
    ("+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp16",
     "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype='fp16'"),
    ("+actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=16",
     "actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=16"),
])
def test_each_setting_that_cannot_agree_is_refused_by_name(checkpoint, override, named):
    with pytest.raises(UnsupportedError) as error:
        check_config(_config(checkpoint, override))
    assert named in str(error.value)


def test_configure_sets_the_engine_and_the_plugin(checkpoint):
    config = configure(_config(checkpoint, "actor_rollout_ref.model.external_lib=my.models"))
    assert list(config.actor_rollout_ref.model.external_lib) == ["my.models", "rl.verl"]
    assert config.ray_kwargs.ray_init.runtime_env.env_vars.MOK_VLLM == "1"
    assert config.ray_kwargs.ray_init.runtime_env.py_executable is None  # verl's own entries stay
    assert configure(config).actor_rollout_ref.model.external_lib == config.actor_rollout_ref.model.external_lib


@pytest.mark.parametrize(("override", "role", "values"), [
    ("+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32", "actor", ("float32", "bfloat16")),
    ("actor_rollout_ref.rollout.dtype=float16", "actor", ("bfloat16", "float16")),
])
def test_configure_compares_the_contracts_and_names_the_dtype(checkpoint, override, role, values):
    config = _config(checkpoint, override)
    with pytest.raises(rl.ContractMismatchError) as error:
        configure(config)
    assert error.value.differences == {"dtype": values}
    assert f"the {role} and the vLLM rollout" in str(error.value)
    assert "MOK_VLLM" not in str(config.get("ray_kwargs"))  # refused before anything was set up


def test_configured_contracts_agree_by_default_and_carry_the_model(checkpoint):
    from transformers import AutoConfig

    contracts = configured_contracts(_config(checkpoint), AutoConfig.from_pretrained(checkpoint))
    assert contracts["actor"] == contracts["rollout"] == contracts["ref"]
    assert contracts["actor"]["arch"] == "qwen3_moe" and contracts["actor"]["dtype"] == "bfloat16"


def test_an_unsupported_model_is_refused_by_configure(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                vocab_size=128).save_pretrained(tmp_path)
    with pytest.raises(rl.UnsupportedModelError, match="llama"):
        configure(_config(tmp_path))


def test_the_engine_wins_verls_registry_on_nvidia(monkeypatch):
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    from rl.verl import MokFSDPEngineWithLMHead

    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cuda")  # verl's own override of the detected device and vendor
    monkeypatch.setenv("VERL_ENGINE_VENDOR", "nvidia")
    for backend in ("fsdp", "fsdp2"):
        assert EngineRegistry.get_engine_cls("language_model", backend) is MokFSDPEngineWithLMHead
    monkeypatch.setenv("VERL_ENGINE_VENDOR", "huawei")  # another vendor keeps verl's engine
    assert EngineRegistry.get_engine_cls("language_model", "fsdp2") is FSDPEngineWithLMHead
    assert EngineRegistry.get_engine_cls("value_model", "fsdp2") is not MokFSDPEngineWithLMHead


@pytest.mark.parametrize(("settings", "named"), [
    ({"strategy": "fsdp"}, "strategy='fsdp'"),
    ({"ulysses_sequence_parallel_size": 2}, "ulysses_sequence_parallel_size=2"),
])
def test_the_engine_refuses_what_it_does_not_implement(checkpoint, settings, named):
    from rl.verl import MokFSDPEngineWithLMHead
    from tests.verl.conftest import build_engine

    with pytest.raises(UnsupportedError) as error:
        build_engine(MokFSDPEngineWithLMHead, checkpoint, **settings)
    assert named in str(error.value)


def test_the_engine_refuses_batch_modes_it_does_not_compute(mok_engine):
    from tests.verl.batches import engine_logprobs, padded_batch, random_rollout

    batch = padded_batch(*random_rollout(0, [3, 4], [2, 2]))
    with pytest.raises(UnsupportedError, match="calculate_sum_pi_squared=True"):
        engine_logprobs(mok_engine, batch, 1.0, calculate_sum_pi_squared=True)
    shifted = dict(batch, position_ids=batch["position_ids"] + 1)
    with pytest.raises(rl.InputError, match="position_ids"):
        engine_logprobs(mok_engine, shifted, 1.0)
    assert torch.isfinite(engine_logprobs(mok_engine, batch, 1.0)[0]).all()


def test_the_plugin_switch_reaches_an_actor_started_like_verls_vllm_servers(checkpoint):
    """A real Ray job started with the runtime environment verl's run_ppo builds from the configured config;
    an actor started the way verl's vLLM replica starts its server actors (its own env_vars) sees MOK_VLLM=1."""
    import ray
    from omegaconf import OmegaConf
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    config = configure(_config(checkpoint))
    runtime_env = OmegaConf.merge(get_ppo_ray_runtime_env(config), config.ray_kwargs.ray_init.runtime_env)  # run_ppo's
    runtime_env = {k: v for k, v in OmegaConf.to_container(runtime_env).items() if v is not None}

    @ray.remote(num_cpus=0)
    class Server:
        def environment(self, *names: str) -> dict:
            return {name: os.environ.get(name) for name in names}

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, runtime_env=runtime_env)
    try:
        server = Server.options(runtime_env={"env_vars": {"NCCL_CUMEM_ENABLE": "0"}}).remote()
        seen = ray.get(server.environment.remote("MOK_VLLM", "NCCL_CUMEM_ENABLE"))
    finally:
        ray.shutdown()
    assert seen == {"MOK_VLLM": "1", "NCCL_CUMEM_ENABLE": "0"}


def test_verls_default_trainer_starts_its_data_plane_from_the_configured_config(checkpoint):
    """verl 0.9.1's default trainer (`trainer.use_v1`) imports transfer_queue and starts it in the Ray job before
    anything else (main_ppo.TaskRunnerV1.run). verl lists that package only under an extra of its own, so the
    GPU run of examples/verl_grpo.py stopped there until the `verl` extra installed it. Started here the way
    TaskRunnerV1 starts it, from the configured config, a row goes in and comes back."""
    import ray
    import transfer_queue

    # each storage unit and the controller hold a CPU of the Ray job: two units here (verl's default is eight)
    config = configure(_config(checkpoint, "transfer_queue.backend.SimpleStorage.num_data_storage_units=2"))
    assert config.trainer.use_v1
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    try:
        transfer_queue.init(config.transfer_queue)
        transfer_queue.kv_put(key="row", partition_id="train", fields={"ids": torch.tensor([3, 1, 4])})
        got = transfer_queue.kv_batch_get(keys=["row"], partition_id="train")
        transfer_queue.close()
    finally:
        ray.shutdown()
    assert [row.tolist() for row in got["ids"].unbind()] == [[3, 1, 4]]  # one row (a jagged tensor of rows)


def test_python_m_rl_verl_refuses_before_ray_starts(checkpoint, tmp_path):
    """The command-line entry composes verl's config from the overrides and refuses, naming the key, with no Ray."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    overrides = [f"actor_rollout_ref.model.path={checkpoint}", *REQUIRED, "actor_rollout_ref.rollout.top_p=0.9",
                 f"hydra.run.dir={tmp_path}"]  # hydra's run folder, not the repository's outputs/
    proc = subprocess.run([sys.executable, "-m", "rl.verl", *overrides], cwd=repo, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HYDRA_FULL_ERROR": "1"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "python -m rl.verl: error: rl.verl: not supported: actor_rollout_ref.rollout.top_p=0.9" in proc.stderr
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr


def test_the_grpo_example_composes_on_verls_config_and_passes_configure(tmp_path):
    """examples/verl_grpo.py's overrides are keys of verl's real config, and rl.verl.configure accepts them (the
    example then needs a GPU: docs/verl.md)."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "examples.verl_grpo", "--check", "--work", str(tmp_path)], cwd=repo,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "external_lib='rl.verl'" in proc.stdout and "'MOK_VLLM': '1'" in proc.stdout
    # verl's agent loop (its Qwen builder) tokenizes the prompts word by word (the GPU run stopped there before the
    # tokenizer had a one-token newline, and special words split others: "t218" -> "t2" "18")
    line = next(line for line in proc.stdout.splitlines() if line.startswith("rollout tokenizes "))
    text, ids = line.removeprefix("rollout tokenizes ").split(" to ")
    assert json.loads(ids) == [int(word[1:]) for word in text.strip("'").split()]
