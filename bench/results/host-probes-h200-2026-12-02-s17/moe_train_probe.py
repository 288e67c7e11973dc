"""Why mok.moe forward+backward at T = 16384 is no faster back to back than from an idle GPU (seventeenth session).

bench/kernel_profile.py's moe_train timeline (s11) read 8.44 ms from an idle GPU, 8.45 back to back, 8.12 of kernels
and 4.36 ms of host time per call (qwen3-30b-a3b): with the host that far ahead, back to back should approach the
kernels' time. Per shape this prints and writes (JSON lines, argv[1]):
- sync_ms (bench/moe.py's timing), b2b_ms (10 calls, no synchronisation), the host's wall clock per call while
  enqueueing those 10 calls (host_b2b_ms) and for one call from an idle GPU (host_idle_ms);
- torch's sync debug mode over one call: the warnings of torch ops that synchronise;
- torch.profiler over 3 calls back to back: CUDA runtime calls (count, host us), the GPU's idle gaps (us, kernels
  around) in calls 2 and 3, and the host ops with the most own CPU time;
- the same timings for bench/moe.py's torch._grouped_mm layer.
    PYTHONPATH=. python3 moe_train_probe.py out.jsonl [shapes]
"""
import json
import sys
import time
import warnings
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from bench.kernel_profile import moe_inputs, moe_train
from bench.moe import grouped_mm_moe, time_ms


def timings(run, calls=10):
    sync_ms = time_ms(run, min_iters=calls, max_iters=calls)
    for _ in range(2):
        run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    wall = time.perf_counter()
    start.record()
    for _ in range(calls):
        run()
    end.record()
    host_b2b = (time.perf_counter() - wall) / calls * 1e3
    torch.cuda.synchronize()
    b2b = start.elapsed_time(end) / calls
    torch.cuda.synchronize()
    wall = time.perf_counter()
    run()
    host_idle = (time.perf_counter() - wall) * 1e3
    torch.cuda.synchronize()
    return dict(sync_ms=round(sync_ms, 4), b2b_ms=round(b2b, 4), host_b2b_ms=round(host_b2b, 4),
                host_idle_ms=round(host_idle, 4))


def sync_warnings(run):
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return [str(w.message).splitlines()[0][:200] for w in caught]


def trace(run, calls=3, top=12):
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    runtime_us, runtime_n, own_us = defaultdict(float), defaultdict(int), defaultdict(float)
    kernels = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.append((event.time_range.start, event.time_range.end, event.name[:60]))
        elif event.name.startswith(("cuda", "cu")):
            runtime_us[event.name] += event.cpu_time_total
            runtime_n[event.name] += 1
        else:
            own_us[event.name] += event.self_cpu_time_total
    kernels.sort()
    gaps, reach, reach_name = [], None, None
    third = len(kernels) // calls
    for start, end, name in kernels[third:]:  # calls 2..: the steady state
        if reach is not None and start > reach + 5:
            gaps.append(dict(us=round(start - reach, 1), after=reach_name, before=name))
        if reach is None or end > reach:
            reach, reach_name = end, name
    gaps.sort(key=lambda g: -g["us"])
    runtime = sorted(((n, runtime_n[n], round(us / calls, 1)) for n, us in runtime_us.items()), key=lambda r: -r[2])
    ops = sorted(((n[:80], round(us / calls, 1)) for n, us in own_us.items()), key=lambda r: -r[1])
    return dict(runtime_per_call=[dict(call=n, count=c / calls, host_us=us) for n, c, us in runtime[:top]],
                idle_gaps_steady=gaps[:top], idle_us_steady=round(sum(g["us"] for g in gaps) / (calls - 1), 1),
                host_ops_own_us=[dict(op=n, us=us) for n, us in ops[:top]])


def baseline(shape, num_tokens):
    x, logits, w13, w2, top_k = moe_inputs(shape, num_tokens)
    leaves = [t.requires_grad_() for t in (x, logits, w13, w2)]
    grad_out = torch.randn_like(x)

    def run():
        for leaf in leaves:
            leaf.grad = None
        grouped_mm_moe(*leaves, top_k).backward(grad_out)

    run()
    return run


def main():
    out = open(sys.argv[1], "w")
    shapes = sys.argv[2].split(",") if len(sys.argv) > 2 else ["qwen3-30b-a3b", "olmoe-1b-7b"]
    for shape in shapes:
        run = moe_train(shape, 16384)
        row = dict(shape=shape, impl="mok", **timings(run), sync_warnings=sync_warnings(run), **trace(run))
        print(json.dumps(row), flush=True)
        out.write(json.dumps(row) + "\n")
        run = None
        torch.cuda.empty_cache()
        run = baseline(shape, 16384)
        row = dict(shape=shape, impl="grouped_mm", **timings(run))
        print(json.dumps(row), flush=True)
        out.write(json.dumps(row) + "\n")
        run = None
        torch.cuda.empty_cache()
    out.close()


if __name__ == "__main__":
    main()
