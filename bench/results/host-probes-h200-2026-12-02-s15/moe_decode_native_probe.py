"""The eager MoE decode call (mok.moe without grad) on the native eager path (mok/kernels/native: the decode plan
replayed from C++) against the Python path's decode plans (mok/kernels/moe/layer.py decode_plans), alternating in one
process, per shape at T = 1 (and qwen3 at T = 16), H200 machine, fifteenth session:

- `event_ms`: bench/moe.py's timing (CUDA events around one call after a synchronisation: the decode_t1_eager_ms of
  moe-latest.json), median of each round;
- `host_us`: wall clock of the same call from an idle GPU, median of 200;
- whether both paths give the same bits.

    PYTHONPATH=. python3 bench/results/host-probes-h200-2026-12-02-s15/moe_decode_native_probe.py
"""
import json
import statistics
import time

import torch

import mok
from bench.kernel_profile import moe_inputs
from bench.moe import time_ms
from mok.kernels import native


def host_us(fn, calls=200):
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return round(statistics.median(times), 1)


assert native.load() is not None
for shape, num_tokens in (("qwen3-30b-a3b", 1), ("olmoe-1b-7b", 1), ("mixtral-8x7b", 1), ("deepseek-v3", 1),
                          ("qwen3-30b-a3b", 16)):
    x, logits, w13, w2, top_k = moe_inputs(shape, num_tokens)

    def run(x=x, logits=logits, w13=w13, w2=w2, top_k=top_k):
        with torch.no_grad():
            return mok.moe(x, logits, w13, w2, top_k)

    row = {"shape": shape, "tokens": num_tokens}
    outputs = {}
    for _ in range(3):
        for path in ("native", "python"):
            native.ENABLED = path == "native"
            outputs[path] = run().clone()
            row.setdefault(f"{path}_event_ms", []).append(round(time_ms(run), 4))
            row.setdefault(f"{path}_host_us", []).append(host_us(run))
    native.ENABLED = True
    row["same_bits"] = bool(torch.equal(outputs["native"], outputs["python"]))
    row["native_stats"] = native.stats()
    print(json.dumps(row), flush=True)
    del x, logits, w13, w2, run
    torch.cuda.empty_cache()
