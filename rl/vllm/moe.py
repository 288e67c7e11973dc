"""vLLM's unquantized MoE layers on mok: the router gate (mok.linear), routing (mok.route) and the
experts (mok.moe), with vLLM's weight layout and no copies.

Legend: T tokens, H hidden, I expert intermediate size, E experts, K top-k.

`MokFusedMoEMethod` replaces `UnquantizedFusedMoEMethod` (vLLM's `register_oot`). It is monolithic:
it receives the raw router logits and routes with mok's definition (softmax in fp32, top-k with ties
to the lower index, fp32 renormalisation), not vLLM's router (bf16 top-k, no tie rule).
`MokGateLinear` replaces `GateLinear` so that the router logits are mok.linear's (bf16, one rounding),
the same bits the trainer computes for the same hidden row.

Routing replay: every layer's topk_ids [T, K] int32 go to vLLM's routed-experts capture when vLLM
binds it (its `routed_experts` output [seq, layers, top_k]; see rl/vllm/routing.py).
"""
from __future__ import annotations

import torch

import mok
from mok.errors import UnsupportedError
from rl.vllm.trace import layer_index, layer_trace_name, worker_tracer

_moe_layers: set[int] = set()
_vllm_config = None  # the worker's config, kept for moe_blocks_forward (which runs outside a forward)


def _refuse(layer_name: str, what: str) -> None:
    raise UnsupportedError(f"mok vLLM hook: MoE layer {layer_name}: {what} is not supported")


def build_classes():
    """The override classes, built on vLLM's (imported only inside vLLM processes)."""
    from vllm.config import get_current_vllm_config_or_none
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    from rl.vllm.overrides import installed_ops

    class MokFusedMoEMethod(UnquantizedFusedMoEMethod):
        """Unquantized MoE through mok.route + mok.moe; weights w13 [E, 2I, H], w2 [E, H, I] as loaded."""

        def __init__(self, moe: FusedMoEConfig):
            # Not UnquantizedFusedMoEMethod.__init__: its backend oracle would pick a kernel that
            # re-packs (CPU) or pads the weights. OOT with no experts class keeps them as loaded.
            FusedMoEMethodBase.__init__(self, moe)
            self.unquantized_backend = UnquantizedMoeBackend.OOT
            self.experts_cls = None
            self.supports_pre_processed_weights = True
            self._name: str | None = None
            self._layer_index = -1
            object.__setattr__(self, "_runner", None)
            self._tracer = worker_tracer()

        @property
        def is_monolithic(self) -> bool:
            return True

        @property
        def supports_eplb(self) -> bool:
            return False

        def process_weights_after_loading(self, layer) -> None:
            """Check the layer, keep its weights as loaded, name it, hook it to vLLM's routing capture."""
            global _vllm_config
            self._check_supported(layer)
            self.moe_quant_config = self.get_fused_moe_quant_config(layer)
            index = layer_index(layer.layer_name)
            if index is None:
                _refuse(layer.layer_name, "a layer name without 'layers.<i>'")
            self._layer_index = index
            self._name = layer_trace_name(layer.layer_name, "moe")
            _moe_layers.add(self._layer_index)
            if self._tracer is not None and "lm_head" not in installed_ops():
                # The last MoE layer ends a forward (with mok's lm_head, lm_head does).
                for other in _moe_layers:
                    self._tracer.forget_closing(layer_trace_name(f"layers.{other}", "moe"))
                self._tracer.close_forward_after(layer_trace_name(f"layers.{max(_moe_layers)}", "moe"))
            _vllm_config = get_current_vllm_config_or_none() or _vllm_config
            # Not a submodule: the runner owns this method's layer (a module cycle would recurse).
            object.__setattr__(self, "_runner", _find_runner(layer.layer_name))
            if self._runner is not None and not hasattr(self._runner, "capture_fn"):
                # Makes the runner a RoutedExpertsCaptureSource: vLLM's routed-experts capture then
                # binds capture_fn there instead of refusing this monolithic method.
                self._runner.capture_fn = None

        def _check_supported(self, layer) -> None:
            name = layer.layer_name
            if layer.expert_map is not None or layer.use_ep:
                _refuse(name, "expert parallelism (an expert_map)")
            if self.moe.has_bias:
                _refuse(name, "expert biases")
            if getattr(layer.activation, "value", str(layer.activation)) != "silu" or not self.moe.is_act_and_mul:
                _refuse(name, f"activation {layer.activation} (mok.moe runs SwiGLU)")
            if layer.apply_router_weight_on_input:
                _refuse(name, "apply_router_weight_on_input")
            if layer.use_grouped_topk or layer.custom_routing_function is not None:
                _refuse(name, "grouped or custom routing")
            if layer.scoring_func != "softmax" or layer.e_score_correction_bias is not None:
                _refuse(name, f"scoring {layer.scoring_func!r} with correction bias")
            if layer.routed_scaling_factor != 1.0:
                _refuse(name, f"routed_scaling_factor {layer.routed_scaling_factor}")
            if layer.w13_weight.dtype != layer.w2_weight.dtype or layer.w13_weight.dim() != 3:
                _refuse(name, "these expert weights")
            if self.moe.hidden_dim != layer.w13_weight.shape[2]:
                _refuse(name, "padded hidden sizes")

        def apply_monolithic(self, layer, x: torch.Tensor, router_logits: torch.Tensor,
                             input_ids: torch.Tensor | None = None) -> torch.Tensor:
            """x: [T, H] bf16, router_logits: [T, E] (bf16 from MokGateLinear) -> [T, H] in x's dtype."""
            topk_ids_TK, topk_weights_TK = mok.route(router_logits, layer.top_k, layer.renormalize)
            capture = getattr(self._runner, "capture_fn", None)
            if capture is not None:  # bound by vLLM's routed-experts capture (rl/vllm/routing.py)
                capture(topk_ids_TK)
            return mok.moe(x, router_logits, layer.w13_weight, layer.w2_weight, layer.top_k, layer.renormalize,
                           topk_ids=topk_ids_TK, topk_weights=topk_weights_TK, name=self._name)

    class MokGateLinear(GateLinear):
        """The MoE router gate through mok.linear (bf16 logits, fp32 accumulation, one rounding)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if not self.is_unquantized:
                raise UnsupportedError(f"mok vLLM hook: quantized router gate {self.prefix} is not supported")
            # Keeps the weight as loaded (vLLM's CPU linear method would re-pack it and drop it).
            from rl.vllm.linear import build_linear_method

            self.quant_method = build_linear_method()
            self._mok_name = layer_trace_name(self.prefix, "router")

        def forward(self, x: torch.Tensor):
            out = mok.linear(x, self.weight, self.bias if not self.skip_bias_add else None, name=self._mok_name)
            if self.out_dtype is not None and out.dtype != self.out_dtype:
                out = out.to(self.out_dtype)
            if not self.return_bias:
                return out
            return out, (self.bias if self.skip_bias_add else None)

    return MokFusedMoEMethod, MokGateLinear


def _find_runner(layer_name: str):
    """vLLM's MoERunner of a RoutedExperts layer (registered under the same name), or None."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is None:
        return None
    return config.compilation_config.static_forward_context.get(layer_name)


def moe_blocks_forward(model: torch.nn.Module, hidden_TH: torch.Tensor) -> dict[int, torch.Tensor]:
    """Feed the same hidden rows [T, H] (bf16) to every MoE block of a vLLM model, in its worker.

    An op-level probe: `llm.apply_model(functools.partial(moe_blocks_forward, hidden_states=x))`
    returns {layer index: [T, H] output} (needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 to send it).
    The block is the MoE runner's parent module (router gate + experts), as the model calls it.
    """
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    if _vllm_config is None:
        raise UnsupportedError("moe_blocks_forward: no MoE layer of this process runs mok's method")
    outputs = {}
    blocks = [(name.rsplit(".", 1)[0], layer_index(name)) for name, module in model.named_modules()
              if isinstance(module, MoERunner)]
    with torch.inference_mode(), set_current_vllm_config(_vllm_config), set_forward_context(None, _vllm_config):
        for block_name, index in blocks:
            outputs[index] = model.get_submodule(block_name)(hidden_TH.clone()).clone()
    return outputs
