"""Host time of the eager decode call with moe_infer's launch plans (mok/kernels/moe/layer.py DECODE_PLANS) and
without (0: every call through the launchers), alternating in one process, per shape at T = 1 (and qwen3 at 16):

- `event_ms`: bench/moe.py's timing (CUDA events around one call after a synchronisation), median of each round;
- `host_us`: wall clock of the same call (mok.moe, no grad), from an idle GPU, median of 200;
- where a planned call's host time goes (median us of 200 each): the public mok.moe, kernels.moe_infer called
  directly, the plan's four launches alone (LaunchPlan.launch), the plan's key, the output's torch.empty;
- whether planned and unplanned calls give the same bits.

    PYTHONPATH=. python3 bench/results/host-probes-h200-2026-12-02-s12/decode_plan_probe.py
"""
import json
import statistics
import time

import torch

import mok
from bench.kernel_profile import moe_inputs
from bench.moe import time_ms
from mok.kernels.moe import layer


def host_us(fn, calls=200):
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return round(statistics.median(times), 1)


for shape, num_tokens in (("qwen3-30b-a3b", 1), ("olmoe-1b-7b", 1), ("mixtral-8x7b", 1), ("deepseek-v3", 1),
                          ("qwen3-30b-a3b", 16)):
    x, logits, w13, w2, top_k = moe_inputs(shape, num_tokens)

    def run():
        with torch.no_grad():
            return mok.moe(x, logits, w13, w2, top_k)

    rounds = {"planned": [], "unplanned": []}
    hosts = {"planned": [], "unplanned": []}
    outputs = {}
    for _ in range(3):
        for label, setting in (("planned", 16), ("unplanned", 0)):
            layer.DECODE_PLANS = setting
            rounds[label].append(round(time_ms(run), 4))
            hosts[label].append(host_us(run))
            outputs[label] = run()
    layer.DECODE_PLANS = 16
    layer._decode_plans.clear()
    run()
    (key, plan), = layer._decode_plans.items()
    per_call = (x, logits, torch.empty_like(x))
    parts = {
        "mok.moe": host_us(run),
        "kernels.moe_infer": host_us(lambda: layer.moe_infer(x, logits, w13, w2, None, None, top_k, True)),
        "plan.launch (4 launches)": host_us(lambda: plan.launch(per_call)),
        "plan key": host_us(lambda: layer._decode_plan_key(per_call, w13, w2, top_k, True)),
        "torch.empty out": host_us(lambda: torch.empty(num_tokens, x.shape[1], device=x.device, dtype=x.dtype)),
    }
    print(json.dumps({"shape": shape, "tokens": num_tokens, "event_ms": rounds, "host_us": hosts,
                      "planned_host_us_parts": parts,
                      "same_bits": bool(torch.equal(outputs["planned"], outputs["unplanned"]))}), flush=True)
    del x, logits, w13, w2
    layer._decode_plans.clear()
    torch.cuda.empty_cache()
