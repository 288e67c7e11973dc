"""vLLM's dense layers on mok's ops: embedding, RMSNorm, linears, rotary, SiluAndMul, lm_head, logprobs.

Each class subclasses vLLM's layer (so isinstance checks and weight loading stay vLLM's) and is
installed by rl/vllm/overrides.py (`register_oot` by class name; the vLLM classes and every other
vLLM internal come from rl/vllm/vllm_internals.py). Trace names: rl/trace_names.py, from each layer's
module path; the ops without one run mok unnamed, as the trainer's do.

`observe_only` (a class attribute, set by overrides.install for MOK_VLLM_SKIP with MOK_TRACE): vLLM's
own computation runs and is only recorded under the trace name, a negative control that a trace diff
must catch.

Shapes: docs/shapes.md.
"""
from __future__ import annotations

import weakref

import torch

import mok
from mok import hooks
from mok.errors import UnsupportedError
from rl import trace_names
from rl.vllm.linear import MokLinearMethod
from rl.vllm.model_check import check_current_model
from rl.vllm.trace import worker_tracer
from rl.vllm.vllm_internals import (
    ColumnParallelLinear,
    LogitsProcessor,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    UnquantizedLinearMethod,
    VocabParallelEmbedding,
)


def _emit(name: str | None, tensor: torch.Tensor, kind: str) -> None:
    if name is not None and hooks.observed():
        hooks.emit(name, tensor, kind)


# -- RMSNorm and its trace names ------------------------------------------------------------------------
# vLLM builds RMSNorm without a prefix, so a norm learns its module path from the model: the first
# module called that holds norms not yet named (the model itself: vLLM calls the model, which calls its
# layers) names each of them from its path in named_modules() ('model.layers.3.input_layernorm' ->
# 'layers.3.input_norm'; q/k norms stay unnamed). A global forward pre-hook (torch's) does it and is
# removed once every norm has its name; weak references let finished models go. Each module is
# searched once (other models called in the same process, a trainer say, cost one walk each).

_unnamed_norms: dict[int, weakref.ref] = {}  # id -> the norm, while it has no name (modules by identity)
_searched: set[int] = set()  # ids of the modules already searched since the last norm was built
_naming_hook: torch.utils.hooks.RemovableHandle | None = None


def _unnamed(module: torch.nn.Module) -> bool:
    ref = _unnamed_norms.get(id(module))
    return ref is not None and ref() is module


def name_norms(model: torch.nn.Module) -> int:
    """Give every unnamed MokRMSNorm inside `model` its trace name from its path there; returns how many.

    Skipped (0) when no norm inside `model` gets a name from its path (a decoder layer called on its
    own, say): the paths must come from the model's root.
    """
    found = [(path, module) for path, module in model.named_modules() if _unnamed(module)]
    named = [(module, trace_names.from_vllm_module(path)) for path, module in found]
    if not any(name is not None for _, name in named):
        return 0
    for module, name in named:
        module.mok_trace_name = name
        del _unnamed_norms[id(module)]
    return len(named)


def _name_norms_before_forward(module: torch.nn.Module, args) -> None:
    global _naming_hook
    if _unnamed_norms and id(module) not in _searched:
        _searched.add(id(module))
        name_norms(module)
    if not _unnamed_norms and _naming_hook is not None:
        _naming_hook.remove()
        _naming_hook = None
        _searched.clear()


def _expect_name(norm: MokRMSNorm) -> None:
    global _naming_hook
    key = id(norm)
    _unnamed_norms[key] = weakref.ref(norm, lambda _, key=key: _unnamed_norms.pop(key, None))
    _searched.clear()  # a module searched before may hold this norm now
    if _naming_hook is None:
        _naming_hook = torch.nn.modules.module.register_module_forward_pre_hook(_name_norms_before_forward)


class MokRMSNorm(RMSNorm):
    """y = mok.rms_norm(x, weight, eps[, residual]); with a residual returns (y, x + residual)."""

    observe_only = False

    def __init__(self, *args, **kwargs):
        check_current_model()
        super().__init__(*args, **kwargs)
        if self.variance_size_override is not None or not self.has_weight:
            raise UnsupportedError("mok vLLM hook: RMSNorm with var_hidden_size or without weight is not supported")
        self.mok_trace_name: str | None = None
        _expect_name(self)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.observe_only:  # the records mok.rms_norm makes: the normalized row, then y
            out = RMSNorm.forward_native(self, x, residual)
            _emit(self.mok_trace_name, x if residual is None else out[1], "input")
            _emit(self.mok_trace_name, out if residual is None else out[0], "output")
            return out
        return mok.rms_norm(x, self.weight, self.variance_epsilon, residual, name=self.mok_trace_name)

    forward_cpu = forward_native
    forward_cuda = forward_native


# -- the other dense ops ----------------------------------------------------------------------------------

class MokRotaryEmbedding(RotaryEmbedding):
    """Rotary embedding of q [T, Q * D] and k [T, G * D] through mok.rotary (fp32 cos/sin)."""

    def _rotate(self, positions_T: torch.Tensor, x_TO: torch.Tensor) -> torch.Tensor:
        """q [T, Q * D] (or k [T, G * D]) -> rotated, same shape."""
        x_TQD = x_TO.reshape(x_TO.shape[0], -1, self.head_size)
        # max_positions: the cos/sin table covers the model's positions (on CUDA, up to its cap; same bits either way)
        out_TQD = mok.rotary(x_TQD, positions_T.reshape(-1).to(torch.int64), float(self.base), self.rotary_dim,
                             bool(self.is_neox_style), max_positions=self.max_position_embeddings)
        return out_TQD.reshape(x_TO.shape)

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


class MokLinear:
    """Mixed into each of vLLM's linear layers: the unquantized method becomes MokLinearMethod (mok.linear,
    weight kept as loaded), and the layer carries its trace name (`layers.{i}.qkv`, `layers.{i}.o_proj`)."""

    observe_only = False

    def __init__(self, *args, **kwargs):
        check_current_model()
        super().__init__(*args, **kwargs)
        if type(self.quant_method) is UnquantizedLinearMethod and not self.observe_only:
            self.quant_method = MokLinearMethod()
        self.mok_trace_name = trace_names.from_vllm_module(self.prefix)

    def forward(self, x: torch.Tensor):
        if not self.observe_only:
            return super().forward(x)
        _emit(self.mok_trace_name, x, "input")
        out = super().forward(x)
        _emit(self.mok_trace_name, out[0] if isinstance(out, tuple) else out, "output")
        return out


class MokQKVParallelLinear(MokLinear, QKVParallelLinear):
    pass


class MokMergedColumnParallelLinear(MokLinear, MergedColumnParallelLinear):
    pass


class MokRowParallelLinear(MokLinear, RowParallelLinear):
    pass


class MokColumnParallelLinear(MokLinear, ColumnParallelLinear):
    pass


class MokReplicatedLinear(MokLinear, ReplicatedLinear):
    pass


LINEARS: tuple[tuple[type, type], ...] = (
    (QKVParallelLinear, MokQKVParallelLinear),
    (MergedColumnParallelLinear, MokMergedColumnParallelLinear),
    (RowParallelLinear, MokRowParallelLinear),
    (ColumnParallelLinear, MokColumnParallelLinear),
    (ReplicatedLinear, MokReplicatedLinear),
)
"""(vLLM class, mok subclass) for every unquantized linear layer."""


class MokVocabParallelEmbedding(VocabParallelEmbedding):
    """The input embedding as a row gather of the weight (exact), traced as `embed`."""

    def __init__(self, *args, **kwargs):
        check_current_model()
        super().__init__(*args, **kwargs)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            raise UnsupportedError("mok vLLM hook: tensor-parallel embeddings are not supported")
        out_TH = self.weight[input_.long()]
        if hooks.observed():
            hooks.emit(trace_names.EMBED, out_TH, "output")
        return out_TH


class MokLogitsProcessor(LogitsProcessor):
    """Logits = mok.linear(hidden, lm_head.weight) in the hidden dtype (bf16), like the trainer."""

    observe_only = False

    def __init__(self, *args, **kwargs):
        check_current_model()
        super().__init__(*args, **kwargs)
        tracer = worker_tracer()
        if tracer is not None:
            tracer.close_forward_after(trace_names.LM_HEAD)  # the last op of every forward

    def _apply_head(self, lm_head, hidden_states: torch.Tensor, embedding_bias: torch.Tensor | None) -> torch.Tensor:
        weight_VH = getattr(lm_head, "weight", None)
        if not isinstance(weight_VH, torch.Tensor) or weight_VH.dim() != 2:
            raise UnsupportedError("mok vLLM hook: lm_head without a plain weight (quantized?) is not supported")
        if self.observe_only:
            logits_TV = LogitsProcessor._apply_head(self, lm_head, hidden_states, embedding_bias)
        else:
            logits_TV = mok.linear(hidden_states, weight_VH, embedding_bias)
        # vLLM pads the vocabulary (to a multiple of 64); record the real columns, as the trainer has them.
        _emit(trace_names.LM_HEAD, hidden_states, "input")
        _emit(trace_names.LM_HEAD, logits_TV[..., : self.org_vocab_size], "output")
        return logits_TV


def compute_logprobs(logits_TV: torch.Tensor) -> torch.Tensor:
    """vLLM's Sampler.compute_logprobs: [T, V] raw logits -> fp32 [T, V] through mok.log_softmax; also the
    log-softmax of processed logits (fp32, divided by the temperature, -inf where top-k/top-p masked)."""
    return mok.log_softmax(logits_TV)
