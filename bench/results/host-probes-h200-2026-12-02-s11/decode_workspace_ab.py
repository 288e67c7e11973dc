"""Written for the next GPU session (not run yet: no device time was left). The eager decode call (mok.moe at
T = 1, no grad) with moe_infer's decode workspace kept between calls (mok/kernels/moe/layer.py,
DECODE_WORKSPACES = 16) and without (0, the default: one built per call), alternating in one process:
bench/moe.py's timing (CUDA events around one call after a synchronisation), median ms of each round, and
whether both give the same bits.

    PYTHONPATH=. python3 bench/results/host-probes-h200-2026-12-02-s11/decode_workspace_ab.py
"""
import torch

import mok
from bench.kernel_profile import moe_inputs
from bench.moe import time_ms
from mok.kernels.moe import layer

kept, default = 16, layer.DECODE_WORKSPACES
for shape in ("qwen3-30b-a3b", "olmoe-1b-7b", "mixtral-8x7b"):
    x, logits, w13, w2, top_k = moe_inputs(shape, 1)

    def run():
        with torch.no_grad():
            return mok.moe(x, logits, w13, w2, top_k)

    rounds = {kept: [], 0: []}
    outputs = {}
    for _ in range(4):
        for setting in (kept, 0):
            layer.DECODE_WORKSPACES = setting
            rounds[setting].append(round(time_ms(run), 4))
            outputs[setting] = run()
    layer.DECODE_WORKSPACES = default
    print(shape, {f"kept ({kept})": rounds[kept], "built per call (0)": rounds[0]},
          "same bits:", bool(torch.equal(outputs[kept], outputs[0])), flush=True)
