"""Ops on a GPU that is not the current one (transformers' device_map="auto" places layers so): every kernel runs on
its tensors' GPU (mok/ops/dispatch.py, on_tensors_device), with the bits of the same call made with that GPU current,
through the native path, the Python path and the custom ops. Needs two GPUs."""
from __future__ import annotations

import pytest
import torch

import mok
from mok.ops import dispatch

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu(2)]


def _calls(device):
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype).requires_grad_()

    x, w = randn(64, 512), randn(512, scale=0.1)
    hidden, logits = randn(48, 256), randn(48, 16, dtype=torch.float32)
    w13, w2 = randn(16, 128, 256, scale=0.05), randn(16, 256, 64, scale=0.05)
    q, k, v = randn(96, 4, 64), randn(96, 2, 64), randn(96, 2, 64)
    cu = torch.tensor([0, 40, 96], dtype=torch.int32, device=device)
    vocab_logits = randn(32, 1000, dtype=torch.float32)
    ids = torch.randint(0, 1000, (32,), generator=gen, device=device)

    def run():
        outs = [mok.rms_norm(x, w, 1e-6), mok.moe(hidden, logits, w13, w2, 4),
                mok.attention(q, k, v, cu, cu, 0.125, causal=True), mok.logprobs(vocab_logits, ids)]
        sum(o.float().sum() for o in outs).backward()
        leaves = (x, w, hidden, logits, w13, w2, q, k, v, vocab_logits)
        return [o.detach() for o in outs] + [t.grad for t in leaves]

    return run


@pytest.mark.parametrize("through_ops", [False, True])
def test_kernels_run_on_their_tensors_gpu(through_ops, monkeypatch):
    monkeypatch.setattr(dispatch, "ENABLED", not through_ops)
    with torch.cuda.device(1):
        want = _calls("cuda:1")()
    torch.cuda.set_device(0)
    torch.cuda.synchronize(0)
    before = torch.cuda.memory_allocated(0)
    got = _calls("cuda:1")()
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
    assert torch.cuda.memory_allocated(0) == before, "nothing of a cuda:1 call lands on cuda:0"
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.device == torch.device("cuda", 1) and torch.equal(a, b), i
