"""mok: deterministic, batch-invariant MoE and dense ops, forward and backward.

Every op has a Triton path (CUDA) and a CPU reference path of the same semantics. The public
names below are imported lazily so that `import mok` stays cheap (no Triton import until a GPU op
runs).
"""
from __future__ import annotations

import importlib

from mok.errors import MokError, UnsupportedError

_EXPORTS = {
    # MoE
    "route": "mok.ops.routing",
    "route_grouped": "mok.ops.grouped_routing",
    "moe": "mok.ops.moe",
    "MoE": "mok.modules",
    # dense ops around it
    "linear": "mok.ops.linear",
    "head_linear": "mok.ops.linear",
    "rms_norm": "mok.ops.rms_norm",
    "rotary": "mok.ops.rotary",
    "silu_and_mul": "mok.ops.silu_and_mul",
    "attention": "mok.ops.attention",
    "paged_attention": "mok.ops.attention",
    "write_kv_cache": "mok.ops.attention",
    "log_softmax": "mok.ops.logprobs",
    "logprobs": "mok.ops.logprobs",
}

__all__ = ["MokError", "UnsupportedError", *_EXPORTS]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mok' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
