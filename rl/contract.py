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
side only, outside SIDE_KEYS, is a difference; so is 1 against True (bool is told from int).
Traces store `comparable(contract)` (SIDE_KEYS dropped) under the run metadata key `execution_contract`,
so a tool that compares every key of two traces' contracts (`mok-verify diff`) applies the same rule;
the sampler's trace keeps the vLLM version and ops in its own metadata keys (`vllm`, `ops`).
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import json
import pkgutil

import torch

from rl.errors import ContractMismatchError, UnsupportedModelError

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


def kernel_configuration(device: torch.device | str) -> str:
    """Which kernel configurations run on `device`: 'reference' (CPU: mok.reference, no launch
    parameters) or 'sha256:<16 hex>' over the upper-case constants (CONFIGS dicts, block sizes) of every
    mok.kernels module (CUDA); 'unavailable: <error>' when the kernels cannot be imported."""
    if torch.device(device).type != "cuda":
        return "reference"
    try:
        import mok.kernels as kernels

        constants = {}
        names = [kernels.__name__] + [m.name for m in pkgutil.walk_packages(kernels.__path__, kernels.__name__ + ".")]
        for name in sorted(names):
            module = importlib.import_module(name)
            for key, value in sorted(vars(module).items()):
                if key.isupper() and isinstance(value, (int, float, str, bool, dict, list, tuple)):
                    constants[f"{name}.{key}"] = value
    except Exception as error:  # noqa: BLE001 - recorded, and then differs from a side that has them
        return f"unavailable: {type(error).__name__}"
    text = json.dumps(constants, sort_keys=True, default=repr)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def runtime_contract(device: torch.device | str) -> dict:
    """The software and hardware part of the contract for computing on `device`."""
    device = torch.device(device)
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


def config_contract(config, dtype: torch.dtype | str) -> dict:
    """The model part of the contract, from a transformers config (the trainer's, or the one vLLM loaded)
    and the dtype the weights compute in."""
    from rl.models import SUPPORTED
    from rl.models.base import check_config, rope

    arch = getattr(config, "model_type", None)
    if arch not in SUPPORTED:
        raise UnsupportedModelError(f"rl: model_type {arch!r} has no execution contract; supported: "
                                    f"{', '.join(SUPPORTED)}")
    check_config(arch, config)
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
    return {
        "arch": arch,
        "dtype": str(dtype).removeprefix("torch."),
        "vocab_size": int(config.vocab_size),
        "hidden_size": int(config.hidden_size),
        "num_layers": int(config.num_hidden_layers),
        "num_heads": int(heads),
        "num_kv_heads": int(getattr(config, "num_key_value_heads", None) or heads),
        "head_dim": int(head_dim),
        "rope_theta": float(theta),
        "rotary_dim": int(rotary_dim),
        "rms_norm_eps": float(config.rms_norm_eps),
        "qk_norm": _QK_NORM[arch],
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


def contract(model: torch.nn.Module) -> dict:
    """The trainer's execution contract of `model` (a supported transformers MoE causal LM, wrapped or not).

    Raises rl.UnsupportedModelError when rl cannot run the model. See the module docstring for the keys.
    """
    from rl.models import adapter_for

    adapter = adapter_for(model)
    weight = adapter.embed.weight
    return {**runtime_contract(weight.device), **config_contract(model.config, weight.dtype)}


def comparable(contract: dict) -> dict:
    """`contract` without SIDE_KEYS: what two sides must agree on; what traces store as `execution_contract`."""
    return {key: value for key, value in contract.items() if key not in SIDE_KEYS}


def check_contract(trainer: dict, sampler: dict) -> None:
    """Raise rl.ContractMismatchError listing every key (outside SIDE_KEYS) whose values differ or that
    only one side has; return None when the contracts agree."""
    keys = (set(trainer) | set(sampler)) - SIDE_KEYS
    missing = object()
    differences = {}
    for key in sorted(keys):
        a, b = trainer.get(key, missing), sampler.get(key, missing)
        if a is missing or b is missing or a != b or isinstance(a, bool) != isinstance(b, bool):
            differences[key] = (None if a is missing else a, None if b is missing else b)
    if differences:
        listed = "; ".join(f"{k}: trainer {'<absent>' if k not in trainer else repr(v[0])} != sampler "
                           f"{'<absent>' if k not in sampler else repr(v[1])}" for k, v in differences.items())
        raise ContractMismatchError(f"execution contracts differ in {len(differences)} key(s): {listed}",
                                    differences)


__all__ = ["SCHEMA", "SIDE_KEYS", "check_contract", "comparable", "config_contract", "contract", "kernel_configuration",
           "runtime_contract"]
