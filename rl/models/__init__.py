"""Per-architecture adapters: which modules of a transformers MoE causal LM feed which mok op.

`adapter_for(model)` returns a `ModelAdapter` (cached on the model) or raises `UnsupportedModelError`
naming what is missing. Supported `config.model_type`s: see `SUPPORTED`.
"""
from __future__ import annotations

import dataclasses
import importlib

import torch
from torch import nn

from rl.models.base import ModelAdapter, UnsupportedModelError

SUPPORTED = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "glm4_moe", "deepseek_v3")

VLLM_SUPPORTED = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "glm4_moe", "deepseek_v3")
"""The architectures the vLLM plugin (MOK_VLLM=1) samples as rl's trainer computes; the others are refused at
engine start (rl/vllm/model_check.py)."""

__all__ = ["SUPPORTED", "VLLM_SUPPORTED", "ModelAdapter", "UnsupportedModelError", "adapter_for"]


def adapter_for(model: nn.Module, rebuild: bool = False) -> ModelAdapter:
    """The model's adapter, built on first use and cached on the model. A module the adapter reads that was
    replaced since (`resize_token_embeddings`'s new lm_head, a LoRA layer injected after wrapping) would be
    silently left out of the compute: UnsupportedModelError naming it, or with rebuild=True (rl.wrap) a new
    adapter of the model as it is now."""
    cached = getattr(model, "_mok_adapter", None)
    if cached is not None:
        if getattr(model, "_mok_adapter_checked_at", None) == _registrations:
            return cached  # no module was set anywhere since the last look: nothing to walk
        replaced = _replaced_module(model)
        if replaced is None:
            object.__setattr__(model, "_mok_adapter_checked_at", _registrations)
            return cached
        if not rebuild:
            raise UnsupportedModelError(
                f"rl: the model's {replaced} is no longer the module rl.wrap read (replaced after wrapping, e.g. by "
                "resize_token_embeddings or an adapter library); call rl.wrap(model) again to use the new one")
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise UnsupportedModelError(
            f"rl: {type(model).__name__} has no config.model_type; pass a transformers *ForCausalLM")
    if model_type not in SUPPORTED:
        raise UnsupportedModelError(
            f"rl: model_type {model_type!r} has no mok adapter (rl/models/{model_type}.py is missing); "
            f"supported: {', '.join(SUPPORTED)}")
    for path, parameter in model.named_parameters():
        if parameter.dtype.is_floating_point and parameter.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise UnsupportedModelError(f"rl: {path} is {parameter.dtype}; mok's ops compute in float32, bfloat16 or "
                                        "float16")
    adapter = importlib.import_module(f"rl.models.{model_type}").build(model)
    object.__setattr__(model, "_mok_adapter", adapter)
    object.__setattr__(model, "_mok_adapter_slots", _slots(model, adapter))
    return adapter


_registrations = 0
"""How many submodules were set on any module in this process (torch's global registration hook: attribute
assignment, add_module, ModuleList items), so that a forward walks the adapter's slots only after one was."""


def _count_registration(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    global _registrations
    _registrations += 1


torch.nn.modules.module.register_module_module_registration_hook(_count_registration)


def _modules_read(value, found: dict[int, nn.Module]) -> dict[int, nn.Module]:
    """Every module an adapter (nested frozen dataclasses and tuples) points at, by id."""
    if isinstance(value, nn.Module):
        found[id(value)] = value
    elif dataclasses.is_dataclass(value):
        for field in dataclasses.fields(value):
            _modules_read(getattr(value, field.name), found)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _modules_read(item, found)
    return found


def _slots(model: nn.Module, adapter: ModelAdapter) -> tuple[tuple[nn.Module, str, nn.Module, str], ...]:
    """(parent, attribute, module, path) for each module the adapter reads and each module above it: the places
    whose replacement changes what the model computes but not what the adapter reads."""
    read = _modules_read(adapter, {})
    modules = dict(model.named_modules())
    paths = set()
    for path, module in modules.items():
        if path and id(module) in read:
            parts = path.split(".")
            paths.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return tuple((modules[path.rpartition(".")[0]], path.rpartition(".")[2], modules[path], path)
                 for path in sorted(paths))


def _replaced_module(model: nn.Module) -> str | None:
    """The path of the first module the cached adapter read that is no longer in its place, or None."""
    for parent, attribute, module, path in getattr(model, "_mok_adapter_slots", ()):
        if parent._modules.get(attribute) is not module:
            return path
    return None
