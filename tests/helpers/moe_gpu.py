"""Shapes, inputs and tile configs shared by the MoE GPU tests (tests/mok/test_moe_gpu.py, test_moe_gpu_paths.py)."""
from __future__ import annotations

import hashlib

import torch

import mok

# (T, H, I, E, K): qwen3-30b-a3b-like, mixtral-like (narrowed I), and odd sizes for the masks.
SHAPES = {
    "qwen3-like": (512, 2048, 768, 128, 8),
    "mixtral-like": (384, 4096, 1792, 8, 2),
    "odd": (123, 520, 200, 6, 3),
}


def make_inputs(num_tokens, hidden, inter, num_experts, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen, device="cuda").to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen, device="cuda")
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen, device="cuda") / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen, device="cuda") / inter ** 0.5).to(dtype)
    return x, logits, w13, w2


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def forward_backward(inputs, top_k, grad_out, renormalize=True):
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = mok.moe(*leaves, top_k, renormalize)
    out.backward(grad_out)
    return [out.detach()] + [t.grad for t in leaves]


def all_configs():
    from mok.kernels.moe.configs import CONFIGS, WIDE_HIDDEN_CONFIGS

    variants = [dict(CONFIGS[size]) for size in CONFIGS]
    variants += [dict(CONFIGS[size], **entries) for size, entries in WIDE_HIDDEN_CONFIGS.items()]
    variants.append({
        "gemm1": dict(BLOCK_M=32, BLOCK_N=64, GROUP_M=2, num_warps=4, num_stages=2),
        "gemm2": dict(BLOCK_M=32, BLOCK_N=32, GROUP_M=1, num_warps=2, num_stages=3),
        "bwd_act": dict(BLOCK_M=64, BLOCK_N=32, GROUP_M=1, num_warps=4, num_stages=2),
        "bwd_dx": dict(BLOCK_M=64, BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=2),
        "weight_grad": dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=2),
    })
    variants.append({
        "gemm1": dict(BLOCK_M=64, BLOCK_N=256, GROUP_M=8, num_warps=8, num_stages=3),
        "gemm2": dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=4, num_warps=8, num_stages=4),
        "bwd_act": dict(BLOCK_M=128, BLOCK_N=64, GROUP_M=8, num_warps=8, num_stages=3),
        "bwd_dx": dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=3),
        "weight_grad": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4),
    })
    # TMA descriptors for the weights (and contiguous A rows), with other BLOCK_K: same bits
    for size, block_k in (("decode", 32), ("large", 64), ("xlarge", 128)):
        variants.append({name: dict(cfg, TMA=1, BLOCK_K=block_k,
                                    num_stages=2 if block_k == 128 else min(cfg["num_stages"], 4))
                         for name, cfg in CONFIGS[size].items()})
    # GEMM 2's L2 prefetch before its PDL wait (only where it scans the routes: the scan test below), other amounts
    decode = CONFIGS["decode"]
    variants.append(dict(decode, gemm2=dict(decode["gemm2"], PREFETCH_K=256)))
    variants.append(dict(decode, gemm2={k: v for k, v in decode["gemm2"].items() if k != "PREFETCH_K"}))
    variants.append(dict(CONFIGS["large"], gemm2=dict(CONFIGS["large"]["gemm2"], PREFETCH_K=1 << 14)))
    # the grouped GEMMs' epilogues with and without LEAN_EPILOGUE (1: int32 offsets, 2: int64 row bases; bwd_act:
    # halves of the accumulator), each config toggled
    for size in ("decode", "large", "xlarge"):
        variants.append(dict(CONFIGS[size], **{name: dict(CONFIGS[size][name],
                                                          LEAN_EPILOGUE=1 - CONFIGS[size][name].get("LEAN_EPILOGUE", 0))
                                               for name in ("gemm2", "bwd_act", "bwd_dx")}))
        variants.append(dict(CONFIGS[size], **{name: dict(CONFIGS[size][name], LEAN_EPILOGUE=2)
                                               for name in ("gemm2", "bwd_act", "bwd_dx")}))
    variants.append(dict(CONFIGS["large"], bwd_act=dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, SORTED_DY=1, TMA=1,
                                                        LEAN_EPILOGUE=1, num_warps=4, num_stages=4)))
    # backward layouts (d y / x rows in schedule order) and weight-grad TMA (full row chunks + pointer tail)
    xlarge = CONFIGS["xlarge"]
    variants.append(dict(xlarge, bwd_act=dict(xlarge["bwd_act"], SORTED_DY=1, TMA=1),
                         weight_grad=dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=32, TMA=1, SORTED_X=1, num_warps=8,
                                          num_stages=4)))
    variants.append(dict(xlarge, weight_grad=dict(BLOCK_M=64, BLOCK_N=128, TMA=1, SORTED_DY=1, num_warps=4,
                                                  num_stages=3)))
    variants.append(dict(xlarge, bwd_act=dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=16, SORTED_DY=1, num_warps=8,
                                              num_stages=3)))
    return variants
