"""Inputs and calls shared by the capture tests (tests/mok/test_capture.py: interpreter and CPU; test_capture_gpu.py:
GPU). torch and mok are imported inside the functions: the interpreter child imports this module too."""
from __future__ import annotations


def moe_inputs(num_tokens, hidden, inter, num_experts, seed=0, device="cpu", dtype=None):
    import torch

    dtype = dtype or torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen, device=device).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen, device=device)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=device) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen, device=device) / inter ** 0.5).to(dtype)
    return x, logits, w13, w2


MOE_MODES = ("route", "replay ids", "replay ids and weights")


def moe_call(mode, top_k):
    import mok

    def call(x, logits, w13, w2, ids, weights):
        kwargs = {"route": {}, "replay ids": {"topk_ids": ids},
                  "replay ids and weights": {"topk_ids": ids, "topk_weights": weights}}[mode]
        return mok.moe(x, logits, w13, w2, top_k, **kwargs)

    return call


def dense_layer(x, residual, norm_weight, weight, bias, logits, positions, ids):
    """Every dense op once: rms_norm (plain and fused), linear, silu_and_mul, rotary, log_softmax, logprobs."""
    import mok

    y, new_residual = mok.rms_norm(x, norm_weight, 1e-6, residual)
    h = mok.linear(mok.rms_norm(y, norm_weight, 1e-5), weight, bias)  # [T, 48]
    act = mok.silu_and_mul(h)  # [T, 24]
    rotated = mok.rotary(h.reshape(h.shape[0], 3, 16), positions, 1e4)
    return new_residual, act, rotated, mok.log_softmax(logits), mok.logprobs(logits, ids)
