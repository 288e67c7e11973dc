"""Per-architecture adapters: which modules of a transformers MoE causal LM feed which mok op.

`adapter_for(model)` returns a `ModelAdapter` (cached on the model) or raises `UnsupportedModelError`
naming what is missing. Supported `config.model_type`s: see `SUPPORTED`.
"""
from __future__ import annotations

import importlib

from torch import nn

from rl.models.base import ModelAdapter, UnsupportedModelError

SUPPORTED = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "glm4_moe", "deepseek_v3")

VLLM_SUPPORTED = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "glm4_moe", "deepseek_v3")
"""The architectures the vLLM plugin (MOK_VLLM=1) samples as rl's trainer computes; the others are refused at
engine start (rl/vllm/model_check.py)."""

__all__ = ["SUPPORTED", "VLLM_SUPPORTED", "ModelAdapter", "UnsupportedModelError", "adapter_for"]


def adapter_for(model: nn.Module) -> ModelAdapter:
    cached = getattr(model, "_mok_adapter", None)
    if cached is not None:
        return cached
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise UnsupportedModelError(
            f"rl: {type(model).__name__} has no config.model_type; pass a transformers *ForCausalLM")
    if model_type not in SUPPORTED:
        raise UnsupportedModelError(
            f"rl: model_type {model_type!r} has no mok adapter (rl/models/{model_type}.py is missing); "
            f"supported: {', '.join(SUPPORTED)}")
    adapter = importlib.import_module(f"rl.models.{model_type}").build(model)
    object.__setattr__(model, "_mok_adapter", adapter)
    return adapter
