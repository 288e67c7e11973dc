"""nn.Module wrappers of mok's ops.

Shapes: docs/shapes.md.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from mok.errors import UnsupportedError
from mok.ops.checks import check_int, check_tensor


class MoE(nn.Module):
    """A SwiGLU mixture-of-experts layer: router linear (mok.linear) + mok.moe.

    Parameters: router_weight [E, H], w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I] —
    the layout of transformers 5.x expert modules and vLLM (docs/contracts.md, "Weight layout"), so
    existing weights can be assigned without copies. forward(hidden [..., H]) -> [..., H] in the
    parameters' dtype.
    `name` (trace prefix) emits f"{name}.router" for the router logits and `name` for the layer.
    `ep_group` (a torch.distributed process group of P ranks): expert parallelism; w13 [E/P, 2I, H] and
    w2 [E/P, H, I] hold this rank's experts `self.experts` = [r * E/P, (r + 1) * E/P) (E must be
    divisible by P; UnsupportedError otherwise), the router stays [E, H]; see mok.moe.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool = True, *, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None, name: str | None = None, ep_group=None):
        super().__init__()
        for label, value in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size),
                             ("num_experts", num_experts), ("top_k", top_k)):
            if check_int(value, f"MoE: {label}") < 1:
                raise UnsupportedError(f"MoE: {label} must be >= 1, got {value!r}")
        if not 1 <= top_k <= num_experts:
            raise UnsupportedError(f"top_k must lie in [1, num_experts={num_experts}], got {top_k}")
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.name = name
        self.ep_group = ep_group
        if ep_group is None:
            self.experts = range(num_experts)
        else:
            from mok.distributed import local_experts

            self.experts = local_experts(num_experts, ep_group)
        kw = dict(dtype=dtype, device=device)
        self.router_weight = nn.Parameter(torch.empty(num_experts, hidden_size, **kw))
        self.w13 = nn.Parameter(torch.empty(len(self.experts), 2 * intermediate_size, hidden_size, **kw))
        self.w2 = nn.Parameter(torch.empty(len(self.experts), hidden_size, intermediate_size, **kw))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.router_weight, std=1.0 / math.sqrt(self.hidden_size))
        nn.init.normal_(self.w13, std=1.0 / math.sqrt(self.hidden_size))
        nn.init.normal_(self.w2, std=1.0 / math.sqrt(self.intermediate_size))

    def router_logits(self, hidden_TH: torch.Tensor) -> torch.Tensor:
        """Router logits [T, E] in the parameters' dtype (batch-invariant mok.linear)."""
        from mok.ops.linear import linear

        name = f"{self.name}.router" if self.name is not None else None
        return linear(hidden_TH, self.router_weight, name=name)

    def forward(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor | None = None,
                topk_weights: torch.Tensor | None = None) -> torch.Tensor:
        """hidden_states [..., H] -> [..., H]; topk_ids / topk_weights [T, K] replay a routing."""
        from mok.ops.moe import moe

        check_tensor(hidden_states, "MoE: hidden_states")
        if hidden_states.dim() == 0 or hidden_states.shape[-1] != self.hidden_size:
            raise UnsupportedError(f"MoE expects [..., {self.hidden_size}], got shape {tuple(hidden_states.shape)}")
        hidden_TH = hidden_states.reshape(-1, self.hidden_size)
        logits_TE = self.router_logits(hidden_TH)
        out_TH = moe(hidden_TH, logits_TE, self.w13, self.w2, self.top_k, self.renormalize,
                     topk_ids=topk_ids, topk_weights=topk_weights, name=self.name, ep_group=self.ep_group)
        return out_TH.reshape(hidden_states.shape)

    def extra_repr(self) -> str:
        ep = ("" if self.ep_group is None else
              f", ep_size={self.num_experts // len(self.experts)}, experts=[{self.experts.start}, {self.experts.stop})")
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"num_experts={self.num_experts}, top_k={self.top_k}, renormalize={self.renormalize}{ep}")
