"""vLLM's dense layers on mok's ops: embedding, RMSNorm, linears, rotary, SiluAndMul, lm_head, logprobs.

Legend: T tokens, H hidden, Hq / Hkv query / key-value heads, D head_dim, V vocabulary.

Each class subclasses vLLM's layer (so isinstance checks and weight loading stay vLLM's) and is
installed by rl/vllm/overrides.py through `register_oot`. Trace names follow the trainer
(rl/models/decoder.py): embed, layers.{i}.input_norm, layers.{i}.qkv, layers.{i}.o_proj,
layers.{i}.post_attention_norm, final_norm, lm_head; the other ops run mok unnamed, as the trainer's.
"""
from __future__ import annotations

import sys
import weakref

import torch

import mok
from mok import hooks
from mok.errors import UnsupportedError
from rl.vllm.linear import build_linear_method
from rl.vllm.trace import layer_index, layer_trace_name, worker_tracer

_LINEAR_NAMES = {"qkv_proj": "qkv", "o_proj": "o_proj"}


def linear_trace_name(prefix: str) -> str | None:
    """'model.layers.2.self_attn.qkv_proj' -> 'layers.2.qkv'; unnamed linears -> None."""
    suffix = _LINEAR_NAMES.get(prefix.rsplit(".", 1)[-1])
    return None if suffix is None else layer_trace_name(prefix, suffix)


# RMSNorm takes no prefix in vLLM. Its trace name comes from the `prefix` of the module whose
# __init__ builds it: a decoder layer ('model.layers.3') builds input_layernorm first and
# post_attention_layernorm second (vLLM's Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE); the model
# ('model') builds the final norm; norms inside attention (q/k norms) stay unnamed, as in the trainer.
# The count is per builder object, so a second model built in the same process (an in-process
# sampler started again) names its norms afresh; weak keys let finished models go.
_norms_per_builder: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()


def _norm_builder() -> tuple[object, str] | None:
    """(module, prefix) of the nearest enclosing `__init__(self, ..., prefix, ...)` of the caller's caller."""
    frame = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            return None
        prefix = frame.f_locals.get("prefix")
        builder = frame.f_locals.get("self")
        if isinstance(prefix, str) and builder is not None and frame.f_code.co_name == "__init__":
            return builder, prefix
        frame = frame.f_back
    return None


def norm_trace_name(builder: object, prefix: str | None) -> str | None:
    """The trace name of the next RMSNorm that `builder` (a module in its __init__, at `prefix`) builds.

    A decoder layer's first norm is 'layers.{i}.input_norm', its second 'layers.{i}.post_attention_norm',
    any further one unnamed; the model's ('model') is 'final_norm'; others (q/k norms) are unnamed.
    """
    if prefix is None:
        return None
    last = prefix.rsplit(".", 1)[-1]
    index = layer_index(prefix)
    if index is not None and last.isdigit():
        count = _norms_per_builder.get(builder, 0)
        _norms_per_builder[builder] = count + 1
        return {0: f"layers.{index}.input_norm", 1: f"layers.{index}.post_attention_norm"}.get(count)
    if index is None and last == "model":
        return "final_norm"
    return None


def _emit(name: str | None, tensor: torch.Tensor, kind: str) -> None:
    if name is not None and hooks.observed():
        hooks.emit(name, tensor, kind)


def build_classes(observe_only: frozenset[str] = frozenset()) -> dict[str, list[tuple[type, type]]]:
    """{op: [(vLLM base class, mok subclass)]} for the dense ops (imported only inside vLLM processes).

    observe_only: ops whose subclass keeps vLLM's computation and only records it under the trace
    name (MOK_VLLM_SKIP with MOK_TRACE: a negative control that a trace diff must catch).
    """
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
        UnquantizedLinearMethod,
    )
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    class MokRMSNorm(RMSNorm):
        """y = mok.rms_norm(x, weight, eps[, residual]); with a residual returns (y, x + residual)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if self.variance_size_override is not None or not self.has_weight:
                raise UnsupportedError("mok vLLM hook: RMSNorm with var_hidden_size or without weight is not supported")
            builder = _norm_builder()
            self._mok_name = None if builder is None else norm_trace_name(*builder)

        def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
            if "rms_norm" in observe_only:  # the records mok.rms_norm makes: normalized row, then y
                out = RMSNorm.forward_native(self, x, residual)
                _emit(self._mok_name, x if residual is None else out[1], "input")
                _emit(self._mok_name, out if residual is None else out[0], "output")
                return out
            return mok.rms_norm(x, self.weight, self.variance_epsilon, residual, name=self._mok_name)

        forward_cpu = forward_native
        forward_cuda = forward_native

    class MokRotaryEmbedding(RotaryEmbedding):
        """Rotary embedding of q [T, Hq * D] and k [T, Hkv * D] through mok.rotary (fp32 cos/sin)."""

        def _rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            shape = x.shape
            x_THD = x.reshape(shape[0], -1, self.head_size)
            out = mok.rotary(x_THD, positions.reshape(-1).to(torch.int64), float(self.base), self.rotary_dim,
                             self.is_neox_style)
            return out.reshape(shape)

        def forward_native(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None):
            return self._rotate(positions, query), (None if key is None else self._rotate(positions, key))

        forward_cpu = forward_native
        forward_cuda = forward_native

    class MokSiluAndMul(SiluAndMul):
        """silu(gate) * up over [T, 2I] -> [T, I] through mok.silu_and_mul."""

        def forward_native(self, x: torch.Tensor) -> torch.Tensor:
            return mok.silu_and_mul(x)

        forward_cpu = forward_native
        forward_cuda = forward_native

    def linear_class(base):
        class MokLinear(base):
            __doc__ = f"vLLM's {base.__name__} with its unquantized method replaced by mok.linear."

            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                if type(self.quant_method) is UnquantizedLinearMethod and "linear" not in observe_only:
                    self.quant_method = build_linear_method()
                self._mok_name = linear_trace_name(self.prefix)

            if "linear" in observe_only:
                def forward(self, x: torch.Tensor):
                    _emit(self._mok_name, x, "input")
                    out = base.forward(self, x)
                    _emit(self._mok_name, out[0] if isinstance(out, tuple) else out, "output")
                    return out

        MokLinear.__name__ = MokLinear.__qualname__ = f"Mok{base.__name__}"
        return MokLinear

    class MokVocabParallelEmbedding(VocabParallelEmbedding):
        """The input embedding as a row gather of the weight (exact), traced as `embed`."""

        def forward(self, input_: torch.Tensor) -> torch.Tensor:
            if self.tp_size > 1:
                raise UnsupportedError("mok vLLM hook: tensor-parallel embeddings are not supported")
            out_TH = self.weight[input_.long()]
            if hooks.observed():
                hooks.emit("embed", out_TH, "output")
            return out_TH

    class MokLogitsProcessor(LogitsProcessor):
        """Logits = mok.linear(hidden, lm_head.weight) in the hidden dtype (bf16), like the trainer."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            tracer = worker_tracer()
            if tracer is not None:
                tracer.close_forward_after("lm_head")  # the last op of every forward

        def _apply_head(self, lm_head, hidden_states: torch.Tensor, embedding_bias: torch.Tensor | None) -> torch.Tensor:
            weight = getattr(lm_head, "weight", None)
            if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
                raise UnsupportedError("mok vLLM hook: lm_head without a plain weight (quantized?) is not supported")
            if "lm_head" in observe_only:
                logits = LogitsProcessor._apply_head(self, lm_head, hidden_states, embedding_bias)
            else:
                logits = mok.linear(hidden_states, weight, embedding_bias)
            # vLLM pads the vocabulary (to a multiple of 64); record the real columns, as the trainer has them.
            _emit("lm_head", hidden_states, "input")
            _emit("lm_head", logits[..., : self.org_vocab_size], "output")
            return logits

    linears = (QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear, ColumnParallelLinear,
               ReplicatedLinear)
    return {
        "rms_norm": [(RMSNorm, MokRMSNorm)],
        "rotary": [(RotaryEmbedding, MokRotaryEmbedding)],
        "silu_and_mul": [(SiluAndMul, MokSiluAndMul)],
        "linear": [(base, linear_class(base)) for base in linears],
        "embedding": [(VocabParallelEmbedding, MokVocabParallelEmbedding)],
        "lm_head": [(LogitsProcessor, MokLogitsProcessor)],
    }


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """vLLM's Sampler.compute_logprobs: [T, V] raw logits -> fp32 [T, V] through mok.log_softmax."""
    return mok.log_softmax(logits)
