"""Written after this session's last device call, for the next GPU session (not run yet). An eager decode step
through 48 MoE layers of qwen3-30b-a3b's sizes (each layer its own weights, as in the model), plans on and off
alternating: median ms per step (CUDA events around the 48 calls), how many plans the step left (one per size:
the final keying substitutes the weights' addresses), how many replays it made, and whether both give the bits.

    PYTHONPATH=. python3 bench/results/host-probes-h200-2026-12-02-s12/decode_plan_layers_probe.py
"""
import json

import torch

import mok
from bench.moe import SHAPES, time_ms
from mok.kernels import launch
from mok.kernels.moe import layer

LAYERS = 48
hidden, inter, num_experts, top_k = SHAPES["qwen3-30b-a3b"]
gen = torch.Generator(device="cuda").manual_seed(0)
weights = [((torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen) * 0.02).bfloat16(),
            (torch.randn(num_experts, hidden, inter, device="cuda", generator=gen) * 0.02).bfloat16())
           for _ in range(LAYERS)]
replays, real_launch = [], launch.LaunchPlan.launch
launch.LaunchPlan.launch = lambda plan, per_call: (replays.append(1), real_launch(plan, per_call))[1]
for num_tokens in (1, 8):
    x = torch.randn(num_tokens, hidden, device="cuda", generator=gen).bfloat16()
    logits = [torch.randn(num_tokens, num_experts, device="cuda", generator=gen) for _ in range(LAYERS)]

    def step():
        with torch.no_grad():
            h = x
            for (w13, w2), router_logits in zip(weights, logits):
                h = mok.moe(h, router_logits, w13, w2, top_k)
            return h

    rounds, outputs = {"planned": [], "unplanned": []}, {}
    for _ in range(3):
        for label, setting in (("planned", 16), ("unplanned", 0)):
            layer.DECODE_PLANS = setting
            layer.clear_decode_plans()
            rounds[label].append(round(time_ms(step), 4))
            outputs[label] = step()
    layer.DECODE_PLANS = 16
    layer.clear_decode_plans()
    before = len(replays)
    step()
    print(json.dumps({"tokens": num_tokens, "layers": LAYERS, "step_ms": rounds,
                      "plans_after_one_step": len(layer._decode_plans), "replays_in_one_step": len(replays) - before,
                      "same_bits": bool(torch.equal(outputs["planned"], outputs["unplanned"]))}), flush=True)
