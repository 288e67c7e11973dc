"""rl.contract: the execution contract, i.e. everything that decides the bits of a forward, as one flat dict.

    trainer = rl.contract(model)                                   # the wrapped trainer model
    sampler = rl.vllm.contract.sampler_contract(llm)               # the same, computed in vLLM's worker
    rl.check_contract(trainer, sampler)                            # ContractMismatchError naming the keys

The trainer and the sampler give the same bits for the same tokens (docs/contracts.md, Bitwise) only
when they agree on: the software (mok, torch, triton versions), the device type and CUDA capability,
the kernel configurations (on CUDA a digest of the launch constants of every mok.kernels module; on
the CPU the reference path), and the model's numbers (architecture, sizes, dtype, rope, norms, routing).
Values are str / int / float / bool / None, so the dict is JSON-able and survives a round trip.

The comparison rule: every key is compared except those in SIDE_KEYS, which only one side has by
nature (the vLLM version and the plugin's op selection exist on the sampler only). A key present on one
side only, outside SIDE_KEYS, is a difference; so is 1 against True (bool is told from int); a NaN agrees
with a NaN. Arguments that are not what the helpers take (a device that is absent or not one mok computes
on, a dtype that is not a float dtype, a contract that is not a dict) raise rl.InputError.
Traces store `comparable(contract)` (SIDE_KEYS dropped) under the run metadata key `execution_contract`,
so a tool that compares every key of two traces' contracts (`mok-verify diff`) applies the same rule;
the sampler's trace keeps the vLLM version and ops in its own metadata keys (`vllm`, `ops`).
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import json
import math
import pkgutil

import torch

from rl.errors import ContractMismatchError, InputError, UnsupportedModelError

SCHEMA = 1
"""Bumped when keys change meaning; it is itself compared (key `contract`)."""

SIDE_KEYS = frozenset({"vllm", "vllm_ops", "vllm_skip"})
"""Keys that only one side has by nature (the sampler's vLLM version and plugin op selection);
`check_contract` does not compare them, and `comparable` drops them."""

_QK_NORM = {"qwen3_moe": "per_head", "mixtral": "none", "olmoe": "whole", "qwen2_moe": "none"}


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def mok_version() -> str | None:
    import mok

    return getattr(mok, "__version__", None) or _version("mok")


def _device(device, label: str) -> torch.device:
    """`device` as a torch.device; rl.InputError for what names none."""
    if not isinstance(device, (torch.device, str, int)) or isinstance(device, bool):
        raise InputError(f"{label}: device must be a torch.device or a device string, got {device!r}")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError) as error:
        raise InputError(f"{label}: {device!r} is not a device ({str(error).splitlines()[0][:120]})") from None


def _compute_device(device, label: str) -> torch.device:
    """A device mok computes on and that is present: the CPU, or an existing CUDA device."""
    device = _device(device, label)
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise InputError(f"{label}: device {device} is not one mok computes on (cpu, cuda)")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = torch.cuda.current_device() if device.index is None and count else device.index or 0
    if index >= count:
        raise InputError(f"{label}: device {device} is not available ({count} CUDA device{'s' if count != 1 else ''})")
    return torch.device("cuda", index)


def _dtype_name(dtype) -> str:
    """'bfloat16' for torch.bfloat16, 'bfloat16' or 'torch.bfloat16'; rl.InputError for what is not a float dtype."""
    named = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
    if not isinstance(named, torch.dtype) or not named.is_floating_point:
        raise InputError(f"config_contract: dtype must be a floating-point torch.dtype or its name, got {dtype!r}")
    return str(named).removeprefix("torch.")


def _contract_dict(value, label: str) -> dict:
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise InputError(f"{label}: a contract is a dict of str keys (rl.contract's result), got "
                         f"{type(value).__name__}")
    return value


def _same(a, b) -> bool:
    """Contract values agree: equal and both bool or both not; a NaN agrees with a NaN."""
    if isinstance(a, bool) != isinstance(b, bool):
        return False
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def kernel_constants(modules) -> dict:
    """{module.NAME: value} of the public upper-case constants of `modules` (configuration dicts, block sizes).
    Private upper-case names are runtime caches (rotary's tables, keyed by tuples and filled by the first call):
    what a process has run must not change its contract."""
    return {f"{module.__name__}.{key}": value for module in modules for key, value in sorted(vars(module).items())
            if key.isupper() and not key.startswith("_")
            and isinstance(value, (int, float, str, bool, dict, list, tuple))}


def kernel_configuration(device: torch.device | str) -> str:
    """Which kernel configurations run on `device`: 'reference' (CPU: mok.reference, no launch
    parameters) or 'sha256:<16 hex>' over the upper-case constants (CONFIGS dicts, block sizes) of every
    mok.kernels module (CUDA); 'unavailable: <error>' when the kernels cannot be imported."""
    if _device(device, "kernel_configuration").type != "cuda":
        return "reference"
    try:
        import mok.kernels as kernels

        names = [kernels.__name__] + [m.name for m in pkgutil.walk_packages(kernels.__path__, kernels.__name__ + ".")]
        constants = kernel_constants([importlib.import_module(name) for name in sorted(names)])
    except Exception as error:  # noqa: BLE001 - recorded, and then differs from a side that has them
        return f"unavailable: {type(error).__name__}"
    text = json.dumps(constants, sort_keys=True, default=repr)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def runtime_contract(device: torch.device | str) -> dict:
    """The software and hardware part of the contract for computing on `device` (the CPU or a present CUDA
    device; rl.InputError for anything else)."""
    device = _compute_device(device, "runtime_contract")
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        capability = f"{major}.{minor}"
    else:
        capability = device.type
    return {
        "contract": SCHEMA,
        "mok": mok_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "device": device.type,
        "cuda_capability": capability,
        "kernels": kernel_configuration(device),
    }


def _dense_layers(arch: str, config) -> list[int]:
    layers = range(config.num_hidden_layers)
    if arch not in ("qwen3_moe", "qwen2_moe"):
        return []
    only = set(getattr(config, "mlp_only_layers", None) or [])
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return [i for i in layers if i in only or not (config.num_experts > 0 and (i + 1) % step == 0)]


def _glm4_moe_keys(config, head_dim: int) -> dict:
    """GLM-4.5's values of the shared keys, and its grouped routing and shared experts (keys only it has)."""
    factor = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
    return {
        "rotary_dim": int(head_dim * factor),
        "qk_norm": "per_head" if getattr(config, "use_qk_norm", False) else "none",
        "num_experts": int(config.n_routed_experts),
        "dense_layers": ",".join(str(i) for i in range(min(config.first_k_dense_replace, config.num_hidden_layers))),
        "dense_intermediate_size": int(config.intermediate_size) if config.first_k_dense_replace else 0,
        "routing": f"grouped_sigmoid n_group={config.n_group} topk_group={config.topk_group} "
                   f"scaling={float(config.routed_scaling_factor)!r}",
        "shared_expert_intermediate_size": int(config.moe_intermediate_size * (config.n_shared_experts or 0)),
    }


def _deepseek_v3_keys(config) -> dict:
    """DeepSeek-V3's MLA sizes, its rope (rotary over qk_rope_head_dim, interleaved or not, YaRN) and softmax scale,
    and its grouped routing, shared experts and dense layers (GLM-4.5's keys)."""
    from rl.models.deepseek_v3 import yarn_scaling

    yarn = yarn_scaling(config)
    return {
        **_glm4_moe_keys(config, config.qk_rope_head_dim),
        "qk_norm": "none",
        "head_dim": int(config.qk_nope_head_dim + config.qk_rope_head_dim),
        "mla": f"q_lora_rank={config.q_lora_rank} kv_lora_rank={config.kv_lora_rank} "
               f"qk_nope_head_dim={config.qk_nope_head_dim} qk_rope_head_dim={config.qk_rope_head_dim} "
               f"v_head_dim={config.v_head_dim} form=absorbed",
        "rope_interleave": bool(getattr(config, "rope_interleave", True)),
        "yarn": None if yarn is None else ",".join(repr(float(v)) for v in yarn),
    }


def config_contract(config, dtype: torch.dtype | str) -> dict:
    """The model part of the contract, from a transformers config (the trainer's, or the one vLLM loaded)
    and the dtype the weights compute in."""
    from rl.models import SUPPORTED
    from rl.models.base import check_config, rope

    arch = getattr(config, "model_type", None)
    if arch not in SUPPORTED:
        raise UnsupportedModelError(f"rl: model_type {arch!r} has no execution contract; supported: "
                                    f"{', '.join(SUPPORTED)}")
    dtype_name = _dtype_name(dtype)
    check_config(arch, config)
    if arch == "deepseek_v3":  # its rope may be YaRN, over qk_rope_head_dim (rl/models/deepseek_v3.py)
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        rotary_dim = config.qk_rope_head_dim
    else:
        theta, rotary_dim = rope(arch, config)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    experts = getattr(config, "num_local_experts", None) if arch == "mixtral" else getattr(config, "num_experts", None)
    moe_intermediate = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    if arch == "mixtral":
        moe_intermediate = config.intermediate_size
    bias = bool(getattr(config, "qkv_bias", False)) if arch == "qwen2_moe" else bool(
        getattr(config, "attention_bias", False))
    dense = _dense_layers(arch, config)
    contract = {
        "arch": arch,
        "dtype": dtype_name,
        "vocab_size": int(config.vocab_size),
        "hidden_size": int(config.hidden_size),
        "num_layers": int(config.num_hidden_layers),
        "num_heads": int(heads),
        "num_kv_heads": int(getattr(config, "num_key_value_heads", None) or heads),
        "head_dim": int(head_dim),
        "rope_theta": float(theta),
        "rotary_dim": int(rotary_dim),
        "rms_norm_eps": float(config.rms_norm_eps),
        "qk_norm": _QK_NORM.get(arch, "none"),
        "clip_qkv": None if getattr(config, "clip_qkv", None) is None else float(config.clip_qkv),
        "qkv_bias": bias,
        "num_experts": int(experts or 0),
        "top_k": int(config.num_experts_per_tok),
        "renormalize": True if arch == "mixtral" else bool(config.norm_topk_prob),
        "moe_intermediate_size": int(moe_intermediate),
        "shared_expert_intermediate_size": int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
        if arch == "qwen2_moe" else 0,
        "dense_layers": ",".join(str(i) for i in dense),
        "dense_intermediate_size": int(config.intermediate_size) if dense else 0,
    }
    if arch == "deepseek_v3":
        return {**contract, **_deepseek_v3_keys(config)}
    return {**contract, **_glm4_moe_keys(config, head_dim)} if arch == "glm4_moe" else contract


def contract(model: torch.nn.Module) -> dict:
    """The trainer's execution contract of `model` (a supported transformers MoE causal LM, wrapped or not).

    Raises rl.UnsupportedModelError when rl cannot run the model. See the module docstring for the keys.
    """
    from rl.models import adapter_for
    from rl.models.decoder import check_materialised

    adapter = adapter_for(model)
    check_materialised(adapter)
    weight = adapter.embed.weight
    return {**runtime_contract(weight.device), **config_contract(model.config, weight.dtype)}


def comparable(contract: dict) -> dict:
    """`contract` without SIDE_KEYS: what two sides must agree on; what traces store as `execution_contract`."""
    return {key: value for key, value in _contract_dict(contract, "comparable").items() if key not in SIDE_KEYS}


def check_contract(trainer: dict, sampler: dict) -> None:
    """Raise rl.ContractMismatchError listing every key (outside SIDE_KEYS) whose values differ or that
    only one side has; return None when the contracts agree. Values agree when equal (bool told from int;
    a NaN agrees with a NaN). rl.InputError when either is not a dict of str keys."""
    _contract_dict(trainer, "check_contract: trainer")
    _contract_dict(sampler, "check_contract: sampler")
    keys = (set(trainer) | set(sampler)) - SIDE_KEYS
    missing = object()
    differences = {}
    for key in sorted(keys):
        a, b = trainer.get(key, missing), sampler.get(key, missing)
        if a is missing or b is missing or not _same(a, b):
            differences[key] = (None if a is missing else a, None if b is missing else b)
    if differences:
        listed = "; ".join(f"{k}: trainer {'<absent>' if k not in trainer else repr(v[0])} != sampler "
                           f"{'<absent>' if k not in sampler else repr(v[1])}" for k, v in differences.items())
        raise ContractMismatchError(f"execution contracts differ in {len(differences)} key(s): {listed}",
                                    differences)


__all__ = ["SCHEMA", "SIDE_KEYS", "check_contract", "comparable", "config_contract", "contract", "kernel_configuration",
           "runtime_contract"]
