"""Where mok.moe forward+backward at T = 16384 spends its host time (cProfile, cumulative and own), and what the
schedule costs on the GPU at the training batch sizes: the Triton sort + tiles kernels (allowed above
SCHEDULE_KERNEL_MAX_SLOTS for this probe) against the torch path, in CUDA graphs, with their integers compared."""
import cProfile
import pstats
import sys

import torch

import mok
from bench.kernel_profile import moe_inputs
from bench.moe_schedule_sweep import graph_us, integers
from mok.kernels.moe import configs
from mok.kernels.moe.schedule import Schedule


def profile_call(shape, tokens):
    *tensors, top_k = moe_inputs(shape, tokens)
    leaves = [t.requires_grad_() for t in tensors]
    grad_out = torch.randn_like(leaves[0])

    def run():
        for leaf in leaves:
            leaf.grad = None
        mok.moe(*leaves, top_k).backward(grad_out)

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3):
        run()
        torch.cuda.synchronize()
    prof.disable()
    print(f"== {shape} T={tokens}: cumulative (ms per call over 3 calls)")
    stats = pstats.Stats(prof, stream=sys.stdout)
    stats.sort_stats("cumulative").print_stats(45)
    print(f"== {shape} T={tokens}: own time")
    stats.sort_stats("tottime").print_stats(25)


def schedule_gpu(num_tokens, num_experts, top_k):
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    ids_TK = torch.rand(num_tokens, num_experts, device="cuda", generator=gen).topk(top_k, -1).indices.to(torch.int32)
    saved = configs.SCHEDULE_KERNEL_MAX_SLOTS
    try:
        configs.SCHEDULE_KERNEL_MAX_SLOTS = 0
        want = integers(Schedule(ids_TK, num_experts))
        torch_us = graph_us(lambda: Schedule(ids_TK, num_experts).tiles(128))
        configs.SCHEDULE_KERNEL_MAX_SLOTS = 1 << 30
        got = integers(Schedule(ids_TK, num_experts, block_m=16))
        kernel_us = graph_us(lambda: Schedule(ids_TK, num_experts, block_m=128))
    finally:
        configs.SCHEDULE_KERNEL_MAX_SLOTS = saved
    equal = all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    print(f"schedule T={num_tokens} E={num_experts} K={top_k}: torch path {torch_us:.1f} us, "
          f"sort+tiles kernels {kernel_us:.1f} us, equal {equal}", flush=True)


for args in [(16384, 8, 2), (16384, 64, 8), (16384, 128, 8), (16384, 256, 8)]:
    schedule_gpu(*args)
profile_call("qwen3-30b-a3b", 16384)
profile_call("mixtral-8x7b", 16384)
