"""One mok.moe forward+backward at T = 16384 under torch.profiler (CPU and CUDA activities), exported as a Chrome
trace per shape (chrome://tracing or Perfetto),
and the call's timing (bench/kernel_profile.py call_split) with the schedule built by the torch path (the limit
as committed) and by the Triton sort + tiles kernels (limit raised), same run.

    PYTHONPATH=. python bench/results/host-probes-h200-2026-12-01-s8/moe_train_trace.py OUT_DIR
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from bench.kernel_profile import call_split, moe_train
from mok.kernels.moe import configs

out_dir = sys.argv[1]
for shape in ("qwen3-30b-a3b", "mixtral-8x7b"):
    run = moe_train(shape, 16384)
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    prof.export_chrome_trace(f"{out_dir}/trace-{shape}.json")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20), flush=True)
    saved = configs.SCHEDULE_KERNEL_MAX_SLOTS
    for limit in (saved, 1 << 20, saved, 1 << 20):
        configs.SCHEDULE_KERNEL_MAX_SLOTS = limit
        print(shape, "schedule kernel max slots", limit, call_split(run), flush=True)
    configs.SCHEDULE_KERNEL_MAX_SLOTS = saved
