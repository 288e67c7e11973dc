"""The `vllm.general_plugins` entry point `mok` (pyproject.toml): `register()`.

vLLM calls it in each of its processes (main, engine core, workers). It does nothing unless the hook
is enabled (MOK_VLLM=1, or VLLM_PLUGINS naming `mok`), refuses unsupported vLLM versions with a
one-line `UnsupportedError` before touching any of vLLM's internals, and installs mok's overrides once
per process (vLLM's registries assert on duplicates, and plugins may be loaded more than once).
"""
from __future__ import annotations

import os

from rl.vllm.options import OBSERVABLE_OPS, enabled, selected_ops, skipped_ops, trace_base
from rl.vllm.versions import SUPPORTED_VLLM, check_vllm_version, vllm_version

__all__ = ["OBSERVABLE_OPS", "SUPPORTED_VLLM", "check_vllm_version", "register", "registered_ops", "vllm_version"]

_registered: frozenset[str] | None = None


def register() -> None:
    """Install mok's overrides in this vLLM process when enabled; a second call is a no-op."""
    global _registered
    if _registered is not None or not enabled():
        return
    check_vllm_version()
    # vLLM 0.26's V2 GPU model runner (its default for Qwen2-MoE and DeepSeek-V2) computes log-probabilities in
    # its own Triton kernel, not through the Sampler that mok patches: one fp32 ulp off on 1 token in 7 (docs/vllm.md).
    # Set here, before vLLM builds its config and spawns its processes (they inherit it); an explicit 1 is
    # refused at model build (rl/vllm/model_check.py).
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    ops = selected_ops()
    # Ops left to vLLM on purpose are still recorded when tracing, so a diff can name them.
    observe_only = skipped_ops() & OBSERVABLE_OPS if trace_base() is not None else frozenset()
    from rl.vllm import overrides  # imports vLLM's internals: only after the version check

    overrides.install(ops, observe_only)
    _registered = ops


def registered_ops() -> frozenset[str] | None:
    """The ops registered in this process, or None when register() has not installed anything."""
    return _registered
