"""Triton kernels of the MoE layer (CUDA; the logic also runs under TRITON_INTERPRET=1 on CPU tensors).

One file per step of the data path, each kernels -> launchers:
  routing.py       softmax, top-k, renormalisation per token (and routing replay); route_token, the one
                   per-token routing code, also runs inside GEMM 1 for a one-token decode
  schedule.py      slots grouped by expert (stable) and the row tiles of each GEMM
  grouped_gemm.py  GEMM 1 + SwiGLU, the grouped GEMM (GEMM 2, d act + SwiGLU backward, d hidden),
                   the weight gradients
  combine.py       the weighted sum over a token's K slots, and its backward
  configs.py       the one CONFIGS dict, size classes, pick_configs
  layer.py         the adapters below, which mok/ops/routing.py and mok/ops/moe.py call (moe_infer:
                   routing and experts of a forward without autograd, one workspace allocation)

Shapes: docs/shapes.md. Kernel rules and why the config may follow the token count: docs/kernels.md.
What is promised bitwise: docs/contracts.md ("Bitwise").
"""
from mok.kernels.moe.layer import BackwardStages, moe_backward, moe_forward, moe_infer, replay_weights, route

__all__ = ["BackwardStages", "moe_backward", "moe_forward", "moe_infer", "replay_weights", "route"]
