"""Which mok class takes over which part of vLLM, per op of rl.vllm.options.OPS: `install`.

The plugin (rl/vllm/plugin.py) checks the vLLM version, then calls `install` once per process. The
mechanics (register_oot, the attention backend registry, the one patched method) and every other vLLM
internal live in rl/vllm/vllm_internals.py, which lists them per vLLM version; docs/vllm.md has the facts.

| op           | vLLM class / hook                                | mok class                                  |
|--------------|--------------------------------------------------|--------------------------------------------|
| moe          | UnquantizedFusedMoEMethod, GateLinear            | MokFusedMoEMethod, MokGateLinear (moe.py)  |
|              | (0.26.0: GLM-4.5's nn.Linear gate, when built)   | MokRouterLinear                            |
| embedding    | VocabParallelEmbedding (input embedding only)    | MokVocabParallelEmbedding (dense.py)       |
| rms_norm     | RMSNorm                                          | MokRMSNorm                                 |
| linear       | QKV/MergedColumn/Row/Column/ReplicatedLinear     | Mok<name> with MokLinearMethod (linear.py) |
| rotary       | RotaryEmbedding (default rope only)              | MokRotaryEmbedding                         |
| silu_and_mul | SiluAndMul                                       | MokSiluAndMul                              |
| lm_head      | LogitsProcessor._apply_head                      | MokLogitsProcessor                         |
| logprobs     | Sampler.compute_logprobs (patched), Sampler.sample | dense.compute_logprobs                   |
|              | (wrapped: processed_logprobs after temperature,  |                                            |
|              | top-k/top-p)                                     |                                            |
| attention    | AttentionBackendEnum.CPU_ATTN (CPU engines)      | MokAttentionBackend (attention.py)         |
|              | every decoder backend of CUDA engines            | MokPagedAttentionBackend (attention_gpu.py)|
|              | (vllm_internals.GPU_DECODER_BACKENDS)            |                                            |
|              | CPU_MLA, AMX_MLA (CPU engines); the dense MLA    | MokMLABackend (mla_cpu.py),                |
|              | backends of CUDA engines (GPU_MLA_BACKENDS)      | MokMLABackend (mla_gpu.py)                 |
|              | MLAAttention.forward_impl,                       | mla.forward,                               |
|              | DeepseekScalingRotaryEmbedding                   | MokDeepseekScalingRotaryEmbedding (mla.py) |
"""
from __future__ import annotations

from rl.vllm import dense, moe, vllm_internals
from rl.vllm.options import OBSERVABLE_OPS

_LAYERS: dict[str, tuple[tuple[type, type], ...]] = {
    "moe": ((vllm_internals.UnquantizedFusedMoEMethod, moe.MokFusedMoEMethod),
            (vllm_internals.GateLinear, moe.MokGateLinear)),
    "embedding": ((vllm_internals.VocabParallelEmbedding, dense.MokVocabParallelEmbedding),),
    "rms_norm": ((vllm_internals.RMSNorm, dense.MokRMSNorm),),
    "linear": dense.LINEARS,
    "rotary": ((vllm_internals.RotaryEmbedding, dense.MokRotaryEmbedding),),
    "silu_and_mul": ((vllm_internals.SiluAndMul, dense.MokSiluAndMul),),
    "lm_head": ((vllm_internals.LogitsProcessor, dense.MokLogitsProcessor),),
}
_OBSERVE_ONLY_FLAGS = {"rms_norm": dense.MokRMSNorm, "linear": dense.MokLinear, "lm_head": dense.MokLogitsProcessor}


def install(ops: frozenset[str], observe_only: frozenset[str] = frozenset()) -> frozenset[str]:
    """Register the overrides of `ops` (names from rl.vllm.options.OPS) in this process; returns the ops
    mok now computes.

    observe_only: ops left to vLLM whose computation is still recorded under their trace names (a subset
    of OBSERVABLE_OPS; others are simply not installed).
    """
    observe_only = (observe_only & OBSERVABLE_OPS) - ops
    vllm_internals.request_cpu_amx()
    installed = set()
    for op, pairs in _LAYERS.items():
        if op in ops or op in observe_only:
            if op in _OBSERVE_ONLY_FLAGS:
                _OBSERVE_ONLY_FLAGS[op].observe_only = op in observe_only
            for base, replacement in pairs:
                vllm_internals.register_layer(base, replacement)
            if op in ops:
                installed.add(op)
    if "linear" in ops or "linear" in observe_only:
        from rl.vllm import mla

        mla.install_linear()
    if "moe" in ops:
        vllm_internals.on_plain_router_gates(moe.as_router_gate)
    # Without mok's lm_head, the last MoE layer ends a forward in the worker's trace.
    moe.MokFusedMoEMethod.ends_forward = not ({"lm_head"} & (ops | observe_only))
    if "logprobs" in ops:
        vllm_internals.patch_compute_logprobs(dense.compute_logprobs)
        vllm_internals.patch_processed_logprobs(dense.compute_logprobs)  # logprobs_mode processed_logprobs (TRL)
        installed.add("logprobs")
    if "attention" in ops or "attention" in observe_only:
        if vllm_internals.is_cpu():
            from rl.vllm.attention import MokAttentionBackend as backend
            from rl.vllm.attention import MokAttentionImpl as impl
        else:
            from rl.vllm.attention_gpu import MokPagedAttentionBackend as backend
            from rl.vllm.attention_gpu import MokPagedAttentionImpl as impl
        impl.observe_only = "attention" in observe_only
        path = f"{backend.__module__}.{backend.__qualname__}"
        if vllm_internals.is_cpu():
            vllm_internals.register_cpu_attention_backend(path)
        else:
            vllm_internals.register_gpu_attention_backend(path)
        if "attention" in ops:  # MLA (DeepSeek-V3 family): its own backend and the patched forward_impl
            from rl.vllm import mla

            if vllm_internals.is_cpu():
                from rl.vllm import mla_cpu as mla_platform
            else:
                from rl.vllm import mla_gpu as mla_platform
            mla.install(mla_platform.MokMLABackend, mla_platform.MokMLAImpl, mla_platform.BACKEND_NAMES)
        if "attention" in ops:
            installed.add("attention")
    return frozenset(installed)
