"""vLLM's unquantized MoE layers on mok: the router gate (mok.linear), routing (mok.route) and the
experts (mok.moe), with vLLM's weight layout and no copies.

GLM-4.5 (grouped top-k over sigmoid scores with a correction bias): routed with mok.route_grouped on the fp32
gate's logits, routed_scaling_factor applied to the weights (as transformers does) and the runner's own scaling
of the routed output turned off; vLLM's runner adds the shared experts' output (bf16), as the trainer does.

`MokFusedMoEMethod` replaces `UnquantizedFusedMoEMethod` (vLLM's `register_oot`). It is monolithic:
it receives the raw router logits and routes with the one definition (docs/contracts.md, Routing),
not vLLM's router (bf16 top-k, no tie rule). `MokGateLinear` replaces `GateLinear` so that the router
logits are mok.linear's (bf16, one rounding), the same bits the trainer computes for the same hidden row; a gate
vLLM builds as a plain torch.nn.Linear (GLM-4.5 in vLLM 0.26.0) becomes a `MokRouterLinear` when built.

Data + expert parallelism (vLLM's `enable_expert_parallel` with `data_parallel_size` >= 2): the layer holds
vLLM's contiguous block of E/P experts and each engine passes its own tokens; mok.moe(ep_group=vLLM's EP
group) exchanges the rows itself (`supports_internal_mk` tells vLLM to skip its naive dispatch/combine),
with the bits of one process. Other layouts (tensor parallelism, round-robin placement, EPLB) are refused
(vllm_internals.moe_expert_parallel).

Routing replay: every layer's topk_ids [T, K] int32 go to vLLM's routed-experts capture when vLLM
binds it (its `routed_experts` output [seq, layers, top_k]; see rl/vllm/routing.py). Every use of a
vLLM internal goes through rl/vllm/vllm_internals.py.

Shapes: docs/shapes.md.
"""
from __future__ import annotations

import torch

import mok
from mok.errors import UnsupportedError
from rl import trace_names
from rl.vllm import vllm_internals
from rl.vllm.linear import MokLinearMethod
from rl.vllm.model_check import check_current_model
from rl.vllm.trace import worker_tracer
from rl.vllm.vllm_internals import FusedMoEConfig, GateLinear, UnquantizedFusedMoEMethod

_moe_layers: set[int] = set()  # the MoE layers built in this process (by decoder layer index)
_vllm_config = None  # the worker's config, kept for moe_blocks_forward (which runs outside a forward)


def _refuse(layer_name: str, what: str) -> None:
    raise UnsupportedError(f"mok vLLM hook: MoE layer {layer_name}: {what} is not supported")


class _SoftmaxView:
    """A FusedMoE layer seen without its grouped sigmoid routing, for the checks of everything else
    (vllm_internals.moe_layer_problem); the routing itself is mok.route_grouped's."""

    def __init__(self, layer):
        object.__setattr__(self, "_layer", layer)

    def __getattr__(self, name):
        overrides = {"use_grouped_topk": False, "scoring_func": "softmax", "e_score_correction_bias": None,
                     "routed_scaling_factor": 1.0}
        return overrides[name] if name in overrides else getattr(self._layer, name)


def _is_grouped_sigmoid(layer) -> bool:
    """GLM-4.5's routing (vLLM's glm4_moe.py): grouped top-k over sigmoid scores, a correction bias."""
    return (bool(layer.use_grouped_topk) and layer.scoring_func == "sigmoid"
            and layer.custom_routing_function is None and layer.e_score_correction_bias is not None)


class MokFusedMoEMethod(UnquantizedFusedMoEMethod):
    """Unquantized MoE through mok.route + mok.moe; weights w13 [E, 2I, H], w2 [E, H, I] as loaded.

    ends_forward (a class attribute, set by overrides.install when mok does not run lm_head): the last
    MoE layer's output ends a model forward, so the worker's trace commits a step there.
    """

    ends_forward = False

    def __init__(self, moe: FusedMoEConfig):
        check_current_model()
        vllm_internals.init_moe_method(self, moe)
        self._name: str | None = None
        # Expert parallelism (vLLM's data + expert parallel engines): mok.moe exchanges the rows itself, over
        # vLLM's EP group, from each rank's own tokens (so vLLM's naive dispatch/combine must not run).
        self._expert_parallel = bool(moe.moe_parallel_config.use_ep)
        self._ep_group = None
        object.__setattr__(self, "_runner", None)
        self._tracer = worker_tracer()
        self._grouped: tuple[int, int, float] | None = None  # (n_group, topk_group, scaling) of grouped routing

    @property
    def is_monolithic(self) -> bool:
        return True

    @property
    def supports_eplb(self) -> bool:
        return False

    @property
    def supports_internal_mk(self) -> bool:
        """True under expert parallelism: the method dispatches and combines itself (mok.moe's ep_group)."""
        return self._expert_parallel

    def process_weights_after_loading(self, layer) -> None:
        """Check the layer, keep its weights as loaded, name it, hook it to vLLM's routing capture."""
        global _vllm_config
        grouped = _is_grouped_sigmoid(layer)
        problem = vllm_internals.moe_layer_problem(_SoftmaxView(layer) if grouped else layer, self.moe)
        if problem is not None:
            _refuse(layer.layer_name, problem)
        self.moe_quant_config = self.get_fused_moe_quant_config(layer)
        self._ep_group = vllm_internals.moe_expert_parallel(layer, self.moe)[0]
        index = trace_names.layer_index(layer.layer_name)
        if index is None:
            _refuse(layer.layer_name, "a layer name without 'layers.<i>'")
        self._name = trace_names.layer(index, trace_names.MOE)
        _moe_layers.add(index)
        if self._tracer is not None and self.ends_forward:
            for other in _moe_layers:
                self._tracer.forget_closing(trace_names.layer(other, trace_names.MOE))
            self._tracer.close_forward_after(trace_names.layer(max(_moe_layers), trace_names.MOE))
        _vllm_config = vllm_internals.current_vllm_config() or _vllm_config
        # Not a submodule: the runner owns this method's layer (a module cycle would recurse).
        object.__setattr__(self, "_runner", vllm_internals.moe_runner(layer.layer_name))
        vllm_internals.keep_shared_experts_opaque(self._runner)
        if grouped:
            self._set_grouped(layer)

    def _set_grouped(self, layer) -> None:
        """Route with mok.route_grouped, the scale in the weights (transformers' Glm4MoeTopkRouter), so the
        runner's bf16 scaling of the routed output is turned off."""
        runner = self._runner
        scaling = float(layer.routed_scaling_factor) * float(getattr(runner, "routed_scaling_factor", 1.0))
        if runner is None or not hasattr(runner, "routed_scaling_factor"):
            _refuse(layer.layer_name, "grouped routing without vLLM's MoE runner")
        if getattr(getattr(runner, "router", None), "num_fused_shared_experts", 0):  # ROCm AITER's shared slot
            _refuse(layer.layer_name, "shared experts fused into the routed experts")
        runner.routed_scaling_factor = 1.0
        gate = getattr(runner, "gate", None)
        if isinstance(gate, MokGateLinear):  # DeepSeek-V3's bf16 gate: fp32 logits, as the trainer's router
            gate.fp32_logits = True
        self._grouped = (int(layer.num_expert_group), int(layer.topk_group), scaling)

    def apply_monolithic(self, layer, x: torch.Tensor, router_logits: torch.Tensor,
                         input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, H] bf16, router_logits: [T, E] (bf16 from MokGateLinear) -> [T, H] in x's dtype."""
        renormalize = bool(layer.renormalize)  # vLLM's setting (a config value; mok's ops take a real bool)
        if self._grouped is None:
            topk_ids_TK, topk_weights_TK = mok.route(router_logits, layer.top_k, renormalize)
        else:
            n_group, topk_group, scaling = self._grouped
            topk_ids_TK, topk_weights_TK = mok.route_grouped(
                router_logits, layer.top_k, n_group=n_group, topk_group=topk_group,
                bias_E=layer.e_score_correction_bias, renormalize=renormalize, scaling=scaling)
        capture = vllm_internals.capture_fn(self._runner)
        if capture is not None:  # bound by vLLM's routed-experts capture (rl/vllm/routing.py)
            capture(topk_ids_TK)
        return mok.moe(x, router_logits, layer.w13_weight, layer.w2_weight, layer.top_k, renormalize,
                       topk_ids=topk_ids_TK, topk_weights=topk_weights_TK, name=self._name, ep_group=self._ep_group)


class MokGateLinear(GateLinear):
    """The MoE router gate through mok.linear (bf16 logits, fp32 accumulation, one rounding). `fp32_logits` (set
    for grouped sigmoid routing): fp32 operands and logits whatever the weight's dtype, as transformers'
    DeepseekV3TopkRouter / Glm4MoeTopkRouter and the trainer compute them."""

    fp32_logits = False

    def __init__(self, *args, **kwargs):
        check_current_model()
        super().__init__(*args, **kwargs)
        # vLLM 0.26.0's GateLinear has no is_unquantized: it is always built without a quant_config.
        if not getattr(self, "is_unquantized", True):
            raise UnsupportedError(f"mok vLLM hook: quantized router gate {self.prefix} is not supported")
        # Keeps the weight as loaded (vLLM's CPU linear method would re-pack it and drop it).
        self.quant_method = MokLinearMethod()
        self.mok_trace_name = trace_names.from_vllm_module(self.prefix)

    def forward(self, x: torch.Tensor):
        weight = self.weight.float() if self.fp32_logits else self.weight
        if x.dtype != weight.dtype:  # an fp32 gate (GLM-4.5): fp32 operands, as the trainer's router
            x = x.to(weight.dtype)
        bias = self.bias if not self.skip_bias_add else None
        out = mok.linear(x, weight, None if bias is None else bias.to(weight.dtype), name=self.mok_trace_name)
        if self.out_dtype is not None and out.dtype != self.out_dtype:
            out = out.to(self.out_dtype)
        if not self.return_bias:
            return out
        return out, (self.bias if self.skip_bias_add else None)


class MokRouterLinear(torch.nn.Linear):
    """A MoE router gate that vLLM builds as a plain torch.nn.Linear (GLM-4.5's fp32 gate in vLLM 0.26.0,
    vllm_internals.on_plain_router_gates), through mok.linear as MokGateLinear and the trainer's router compute it:
    fp32 operands, logits [T, E] in fp32. `as_router_gate` turns the built nn.Linear into one, parameters kept."""

    mok_trace_name: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype:
            x = x.to(self.weight.dtype)
        return mok.linear(x, self.weight, self.bias, name=self.mok_trace_name)


def as_router_gate(gate: torch.nn.Linear, prefix: str) -> None:
    """Make the plain nn.Linear router gate `gate` (module path `prefix`) a MokRouterLinear, in place."""
    check_current_model()
    gate.__class__ = MokRouterLinear
    gate.mok_trace_name = trace_names.from_vllm_module(prefix)


def moe_blocks_forward(model: torch.nn.Module, hidden_TH: torch.Tensor) -> dict[int, torch.Tensor]:
    """Feed the same hidden rows [T, H] (bf16) to every MoE block of a vLLM model, in its worker.

    An op-level probe: `llm.apply_model(functools.partial(moe_blocks_forward, hidden_TH=x))`
    returns {layer index: [T, H] output} (needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 to send it).
    The block is the MoE runner's parent module (router gate + experts), as the model calls it.
    """
    if _vllm_config is None:
        raise UnsupportedError("moe_blocks_forward: no MoE layer of this process runs mok's method")
    outputs = {}
    with vllm_internals.probe_context(_vllm_config):
        for block, runner in vllm_internals.moe_blocks(model):
            outputs[trace_names.layer_index(runner)] = model.get_submodule(block)(hidden_TH.clone()).clone()
    return outputs
