"""The driver side of rl.verl: verl's PPO config checked, compared and set up for mok on both sides, before Ray
starts. The names are re-exported by rl.verl (see its docstring)."""
from __future__ import annotations

from collections.abc import Callable

import torch

from mok.errors import UnsupportedError
from rl.contract import check_contract, config_contract, runtime_contract
from rl.errors import ContractMismatchError
from rl.logprobs import GREEDY_TEMPERATURE, sampling_temperature
from rl.models import UnsupportedModelError
from rl.releases import check_tested_release

TESTED_VERL = ("0.9",)
"""verl release lines (major.minor) this module was tested with (pyproject extra `verl`)."""

MODULE = "rl.verl"
"""What `configure` adds to actor_rollout_ref.model.external_lib (verl imports it where it builds the model)."""

ENABLE_ENV = "MOK_VLLM"
"""rl.vllm.options.ENABLE_ENV, the plugin's switch; not imported from there: the rl.vllm package imports vLLM,
which verl's trainer processes need not have."""

_PRECISION = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "16": "float16",
              "fp32": "float32", "float32": "float32", "32": "float32",
              **{str(dtype): str(dtype).removeprefix("torch.")
                 for dtype in (torch.bfloat16, torch.float16, torch.float32)}}
"""verl's precision spellings (PrecisionType: 16, "fp16", torch.float16, ... as their str) -> torch dtype names."""


def check_verl_version() -> str:
    """The installed verl version, or UnsupportedError when it is outside TESTED_VERL."""
    return check_tested_release("verl", "verl", TESTED_VERL, "rl.verl")


def _get(config, dotted: str, default=None):
    """config's value at a dotted key (DictConfig or nested dicts); `default` where absent, null or `???`."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(config):
        value = OmegaConf.select(config, dotted, default=None, throw_on_missing=False)
        return default if value is None or OmegaConf.is_missing(config, dotted) else value
    node = config
    for key in dotted.split("."):
        node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            return default
    return node


def check_config(config) -> None:
    """Refuse the verl settings (the full PPO config: a DictConfig or nested dicts) under which the actor's
    log-probabilities cannot equal vLLM's, or that rl.verl does not implement: one UnsupportedError naming
    the first one found by its full key and value."""
    rollout, model = "actor_rollout_ref.rollout", "actor_rollout_ref.model"
    problems = []

    def refuse(key: str, default, allowed: Callable[[object], bool], why: str) -> None:
        value = _get(config, key, default)
        if not allowed(value):
            problems.append(f"{key}={value!r} ({why})")

    refuse(f"{rollout}.name", None, lambda v: v == "vllm", "the mok plugin is a vLLM plugin")
    refuse(f"{rollout}.tensor_model_parallel_size", 1, lambda v: v == 1,
           "a tensor-parallel rollout splits the reductions: set 1")
    refuse(f"{rollout}.pipeline_model_parallel_size", 1, lambda v: v == 1, "set 1")
    refuse(f"{rollout}.top_k", -1, lambda v: v in (-1, 0), "top-k masking is not in the actor's log-probs")
    refuse(f"{rollout}.top_p", 1.0, lambda v: v == 1.0, "top-p masking is not in the actor's log-probs")
    refuse(f"{rollout}.min_p", 0.0, lambda v: v == 0.0, "min-p masking is not in the actor's log-probs")
    refuse(f"{rollout}.repetition_penalty", 1.0, lambda v: v == 1.0, "it changes vLLM's logits")
    refuse(f"{rollout}.do_sample", True, lambda v: v is True, "greedy rollouts report raw log-probs")
    refuse(f"{rollout}.temperature", 1.0, sampling_temperature,
           f"not a finite number >= vLLM's greedy threshold {GREEDY_TEMPERATURE}")
    refuse(f"{rollout}.engine_kwargs.vllm.model_impl", "vllm", lambda v: v in ("vllm", "auto"),
           "the plugin replaces vLLM's own model code; transformers' in vLLM runs other ops")
    refuse(f"{rollout}.engine_kwargs.vllm.kv_cache_dtype", "auto", lambda v: v in ("auto", None),
           "the KV cache holds the model's dtype")
    refuse(f"{rollout}.logprobs_mode", "processed_logprobs", lambda v: v == "processed_logprobs",
           "the actor computes processed log-probs, after the temperature")
    refuse(f"{rollout}.quantization", None, lambda v: v is None, "vLLM would compute with other weights")
    for role in ("actor", "ref"):
        refuse(f"actor_rollout_ref.{role}.strategy", "fsdp", lambda v: v == "fsdp2",
               "the mok engine is an FSDP2 engine: set fsdp2")
        refuse(f"actor_rollout_ref.{role}.fsdp_config.mixed_precision.param_dtype", "bf16",
               lambda v: _PRECISION.get(str(v)) != "float16", "the mok engine trains in bf16 or fp32")
        refuse(f"actor_rollout_ref.{role}.ulysses_sequence_parallel_size", 1, lambda v: v == 1,
               "sequence parallelism splits sequences across ranks; mok's decoder computes whole sequences")
    refuse(f"{model}.use_fused_kernels", False, lambda v: v is False, "verl's fused log-prob kernels replace mok's")
    refuse(f"{model}.use_liger", False, lambda v: v is False, "Liger kernels replace mok's")
    refuse(f"{model}.lora_rank", 0, lambda v: v == 0, "LoRA: mok computes the full model's weights")
    refuse(f"{model}.enable_activation_offload", False, lambda v: v is False, "not implemented by the mok engine")
    refuse("actor_rollout_ref.actor.calculate_sum_pi_squared", False, lambda v: v is False,
           "not computed by the mok engine")
    if problems:
        raise UnsupportedError(f"rl.verl: not supported: {problems[0]}")


def _compute_dtype(config, role: str) -> str:
    """The dtype `role`'s forward computes in: its FSDP2 mixed-precision param_dtype (verl's default bf16)."""
    name = str(_get(config, f"actor_rollout_ref.{role}.fsdp_config.mixed_precision.param_dtype", "bf16"))
    return _PRECISION.get(name, name)


def configured_contracts(config, hf_config) -> dict[str, dict]:
    """The execution contracts of the actor, the reference policy and the rollout as `config` sets them up.
    hf_config: the model's transformers config. Model part: hf_config with each side's compute dtype (the
    FSDP2 mixed-precision param_dtype; the rollout's `dtype`); runtime part: this process's software and
    device, for every side (verl's hybrid engine runs the rollout on the actor's GPUs, in its image).
    Returns {"actor": ..., "ref": ..., "rollout": ...}."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    runtime = runtime_contract(device)
    rollout_dtype = str(_get(config, "actor_rollout_ref.rollout.dtype", "bfloat16"))
    dtypes = {"actor": _compute_dtype(config, "actor"), "ref": _compute_dtype(config, "ref"),
              "rollout": _PRECISION.get(rollout_dtype, rollout_dtype)}
    return {role: {**runtime, **config_contract(hf_config, dtype)} for role, dtype in dtypes.items()}


def check_configured_contracts(config, hf_config) -> None:
    """rl.ContractMismatchError (naming the role and the differing keys) when the actor's or the reference
    policy's configured contract differs from the rollout's."""
    contracts = configured_contracts(config, hf_config)
    for role in ("actor", "ref"):
        try:
            check_contract(contracts[role], contracts["rollout"])
        except ContractMismatchError as error:
            raise ContractMismatchError(f"rl.verl: the {role} and the vLLM rollout cannot agree: {error}",
                                        error.differences) from None


def _hf_config(model):
    from omegaconf import OmegaConf
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model.get("hf_config_path") or model.path,
                                           trust_remote_code=bool(model.get("trust_remote_code", False)))
    overrides = model.get("override_config") or {}
    overrides = OmegaConf.to_container(overrides) if OmegaConf.is_config(overrides) else dict(overrides)
    for key, value in overrides.items():
        if hasattr(hf_config, key):  # what verl overrides on both sides
            setattr(hf_config, key, value)
    return hf_config


def configure(config):
    """verl's PPO config (an omegaconf DictConfig) -> the same config, checked and set up for mok on both sides
    (changed in place; returned for chaining): `actor_rollout_ref.model.external_lib` gains "rl.verl" (the mok
    engine, in every worker that builds the model) and the Ray job's runtime environment gains MOK_VLLM=1
    (the plugin, in verl's vLLM servers). Raises UnsupportedError (check_verl_version, check_config; an
    unsupported model: rl.UnsupportedModelError) or rl.ContractMismatchError before anything starts."""
    from omegaconf import OmegaConf, open_dict

    check_verl_version()
    check_config(config)
    model = config.actor_rollout_ref.model
    check_configured_contracts(config, _hf_config(model))
    with open_dict(config):
        libs = model.get("external_lib")
        libs = [] if libs is None else [libs] if isinstance(libs, str) else list(libs)
        if MODULE not in libs:
            model.external_lib = MODULE if not libs else [*libs, MODULE]
    OmegaConf.update(config, f"ray_kwargs.ray_init.runtime_env.env_vars.{ENABLE_ENV}", "1", force_add=True)
    return config


def main(argv: list[str] | None = None) -> None:
    """`python -m rl.verl [overrides]`: verl's `main_ppo` (same hydra config and overrides) with `configure`
    applied to its config."""
    import os
    import sys

    import hydra
    from verl.trainer import main_ppo

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    config_dir = os.path.join(os.path.dirname(main_ppo.__file__), "config")

    @hydra.main(config_path=config_dir, config_name="ppo_trainer", version_base=None)
    def run(config) -> None:
        try:
            configured = configure(config)
        except (UnsupportedError, ContractMismatchError, UnsupportedModelError) as error:  # one line, nothing started
            print(f"python -m rl.verl: error: {error}", file=sys.stderr)
            sys.exit(2)
        main_ppo.main.__wrapped__(configured)

    run()
