"""Inputs shared by the dense ops' GPU tests (tests/mok/test_dense_gpu.py, test_dense_gpu_native.py)."""
import torch

DEVICE = "cuda"


def randn(*shape, dtype=torch.bfloat16, seed=0, scale=1.0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=DEVICE) * scale).to(dtype)
