"""mok.moe / mok.MoE on the CPU reference path: accuracy, gradients, batch invariance, determinism,
routing replay, torch.compile, hooks, errors. (CUDA: test_moe_gpu.py; Triton logic: test_moe_interpret.py.)"""
from __future__ import annotations

import pytest
import torch

import mok
from tests.helpers.moe_plain import plain_moe, plain_route

# (T, H, I, E, K)
SHAPES = [(5, 64, 32, 4, 2), (7, 40, 24, 6, 3), (4, 33, 17, 5, 1)]
# (dtype, atol, rtol) against plain torch with mok's rounding points: the only differences are fp32
# summation orders, so a couple of ulps of the dtype.
DTYPES = [(torch.bfloat16, 2e-2, 2e-2), (torch.float16, 2e-3, 2e-3), (torch.float32, 1e-5, 1e-5)]


def make_inputs(num_tokens, hidden, inter, num_experts, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x_TH = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    logits_TE = torch.randn(num_tokens, num_experts, generator=gen)
    w13_E2IH = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    w2_EHI = (torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5).to(dtype)
    return x_TH, logits_TE, w13_E2IH, w2_EHI


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_forward_matches_plain_torch(shape, dtype, atol, rtol):
    num_tokens, hidden, inter, num_experts, top_k = shape
    x, logits, w13, w2 = make_inputs(num_tokens, hidden, inter, num_experts, dtype)
    out = mok.moe(x, logits, w13, w2, top_k)
    assert out.dtype == dtype and out.shape == (num_tokens, hidden)
    torch.testing.assert_close(out, plain_moe(x, logits, w13, w2, top_k), atol=atol, rtol=rtol)
    # and against all-fp32 math within the dtype's tolerance
    expected32 = plain_moe(x, logits, w13, w2, top_k, rounded=False)
    torch.testing.assert_close(out.float(), expected32, atol=4 * atol, rtol=4 * rtol)


@pytest.mark.parametrize("shape", SHAPES[:2])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype,atol,rtol", [DTYPES[0], DTYPES[2]])
def test_gradients_match_autograd_of_plain_torch(shape, renormalize, dtype, atol, rtol):
    num_tokens, hidden, inter, num_experts, top_k = shape
    inputs = make_inputs(num_tokens, hidden, inter, num_experts, dtype, seed=1)
    grad_out = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(2)).to(dtype)
    ours = [t.clone().requires_grad_() for t in inputs]
    mok.moe(*ours, top_k, renormalize).backward(grad_out)
    theirs = [t.clone().requires_grad_() for t in inputs]
    plain_moe(*theirs, top_k, renormalize).backward(grad_out)
    for label, a, b in zip(("hidden", "logits", "w13", "w2"), ours, theirs):
        assert a.grad is not None and a.grad.dtype == b.dtype, label
        scale = b.grad.abs().max().item()
        torch.testing.assert_close(a.grad.float(), b.grad.float(), atol=atol * max(scale, 1.0), rtol=rtol, msg=label)


def test_topk_weights_gradient_and_replay():
    x, logits, w13, w2 = make_inputs(6, 32, 16, 4, seed=3)
    ids, weights = mok.route(logits, 2)
    grad_out = torch.randn(6, 32).bfloat16()
    w_ours = weights.clone().requires_grad_()
    out = mok.moe(x, logits, w13, w2, 2, topk_ids=ids, topk_weights=w_ours)
    out.backward(grad_out)
    w_theirs = weights.clone().requires_grad_()
    plain_moe(x, logits, w13, w2, 2, topk_ids=ids, topk_weights=w_theirs).backward(grad_out)
    torch.testing.assert_close(w_ours.grad, w_theirs.grad, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("renormalize", [True, False])
def test_replay_equals_routing_from_logits(renormalize):
    x, logits, w13, w2 = make_inputs(9, 48, 24, 6, seed=4)
    out = mok.moe(x, logits, w13, w2, 3, renormalize)
    ids, weights = mok.route(logits, 3, renormalize)
    assert torch.equal(mok.moe(x, logits, w13, w2, 3, renormalize, topk_ids=ids, topk_weights=weights), out)
    assert torch.equal(mok.moe(x, logits, w13, w2, 3, renormalize, topk_ids=ids), out)
    # replayed ids with weights from the logits: gradients reach the logits
    logits_g = logits.clone().requires_grad_()
    mok.moe(x, logits_g, w13, w2, 3, renormalize, topk_ids=ids).float().sum().backward()
    assert logits_g.grad is not None and logits_g.grad.abs().sum() > 0


def test_batch_invariance_alone_in_batches_permuted_and_inference():
    num_tokens, hidden, inter, num_experts, top_k = 40, 32, 16, 8, 2
    x, logits, w13, w2 = make_inputs(num_tokens, hidden, inter, num_experts, seed=5)
    gen = torch.Generator().manual_seed(6)
    probe = [0, 13, 39]
    alone = {t: mok.moe(x[t:t + 1], logits[t:t + 1], w13, w2, top_k)[0] for t in probe}
    others = torch.tensor([t for t in range(num_tokens) if t not in probe])
    for extra in (0, 14, num_tokens - len(probe)):
        for _ in range(2):
            chosen = others[torch.randperm(len(others), generator=gen)[:extra]]
            rows = torch.cat([torch.tensor(probe), chosen])
            rows = rows[torch.randperm(len(rows), generator=gen)]
            out = mok.moe(x[rows], logits[rows], w13, w2, top_k)
            for t in probe:
                where = (rows == t).nonzero()[0, 0]
                assert torch.equal(out[where], alone[t]), (extra, t)
    # training forward (autograd recording) vs inference mode
    trained = mok.moe(x.clone().requires_grad_(), logits, w13.clone().requires_grad_(), w2, top_k)
    with torch.inference_mode():
        inferred = mok.moe(x, logits, w13, w2, top_k)
    assert torch.equal(trained.detach(), inferred)
    for t in probe:
        assert torch.equal(inferred[t], alone[t])


def test_rerun_determinism_forward_and_backward():
    inputs = make_inputs(11, 32, 16, 4, seed=7)
    grad_out = torch.randn(11, 32, generator=torch.Generator().manual_seed(8)).bfloat16()

    def run():
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = mok.moe(*leaves, 2)
        out.backward(grad_out)
        return [out.detach()] + [t.grad for t in leaves]

    first = run()
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(first, run()))


def test_unused_experts_get_zero_weight_gradients():
    x, logits, w13, w2 = make_inputs(3, 16, 8, 6, seed=9)
    logits = torch.full((3, 6), -5.0)
    logits[:, 1] = 3.0
    w13 = w13.clone().requires_grad_()
    mok.moe(x, logits, w13, w2, 1).float().sum().backward()
    used = torch.zeros(6, dtype=torch.bool)
    used[1] = True
    assert bool((w13.grad[~used] == 0).all()) and bool((w13.grad[used] != 0).any())


def test_empty_batch():
    x, logits, w13, w2 = make_inputs(0, 16, 8, 4)
    out = mok.moe(x, logits, w13, w2, 2)
    assert out.shape == (0, 16)


def test_torch_compile_traces_the_custom_ops():
    torch._dynamo.reset()
    x, logits, w13, w2 = make_inputs(3, 16, 8, 4, seed=10)
    compiled = torch.compile(lambda *a: mok.moe(*a, 2), backend="aot_eager", fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in (x, logits, w13, w2)]
    out = compiled(*leaves)
    assert torch.equal(out, mok.moe(x, logits, w13, w2, 2))
    out.float().sum().backward()
    assert all(t.grad is not None for t in leaves)


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(7, 16, dtype=torch.bfloat16)
        out = mok.moe(x, torch.empty(7, 4), torch.empty(4, 16, 16, dtype=torch.bfloat16),
                      torch.empty(4, 16, 8, dtype=torch.bfloat16), 2)
        assert out.shape == (7, 16) and out.dtype == torch.bfloat16


def test_hooks_emit_input_and_output_when_named():
    x, logits, w13, w2 = make_inputs(3, 16, 8, 4)
    seen = []
    with mok.hooks.observe(lambda name, t, kind: seen.append((name, kind, tuple(t.shape)))):
        out = mok.moe(x, logits, w13, w2, 2, name="layers.0.moe")
        mok.moe(x, logits, w13, w2, 2)
    assert seen == [("layers.0.moe", "input", (3, 16)), ("layers.0.moe", "output", (3, 16))]
    assert out.shape == (3, 16)


def test_module_forward_backward_and_replay():
    torch.manual_seed(0)
    layer = mok.MoE(32, 16, 4, 2, name="layers.0.moe")
    x = torch.randn(2, 3, 32).bfloat16()
    out = layer(x)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    logits = layer.router_logits(x.reshape(-1, 32))
    expected = plain_moe(x.reshape(-1, 32), logits, layer.w13.detach(), layer.w2.detach(), 2)
    torch.testing.assert_close(out.reshape(-1, 32), expected, atol=2e-2, rtol=2e-2)
    ids, weights = plain_route(logits.detach(), 2)
    assert torch.equal(layer(x, topk_ids=ids.int()), out)
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters())
    names = []
    with mok.hooks.observe(lambda name, t, kind: names.append((name, kind))):
        layer(x)
    assert ("layers.0.moe", "output") in names and ("layers.0.moe.router", "output") in names


BAD = {
    "int hidden": lambda x, l, a, b: mok.moe(x.int(), l, a, b, 2),
    "fp64 hidden": lambda x, l, a, b: mok.moe(x.double(), l, a.double(), b.double(), 2),
    "weight dtype": lambda x, l, a, b: mok.moe(x, l, a.float(), b, 2),
    "3d hidden": lambda x, l, a, b: mok.moe(x[None], l, a, b, 2),
    "w13 odd rows": lambda x, l, a, b: mok.moe(x, l, a[:, :-1], b, 2),
    "w2 shape": lambda x, l, a, b: mok.moe(x, l, a, b[:, :, :-1], 2),
    "hidden size": lambda x, l, a, b: mok.moe(x[:, :-1], l, a, b, 2),
    "logits shape": lambda x, l, a, b: mok.moe(x, l[:, :-1], a, b, 2),
    "top_k": lambda x, l, a, b: mok.moe(x, l, a, b, 5),
    "weights without ids": lambda x, l, a, b: mok.moe(x, l, a, b, 2, topk_weights=torch.ones(3, 2)),
    "ids range": lambda x, l, a, b: mok.moe(x, l, a, b, 2, topk_ids=torch.full((3, 2), 4)),
    "ids shape": lambda x, l, a, b: mok.moe(x, l, a, b, 2, topk_ids=torch.zeros(3, 3, dtype=torch.int32)),
    "ids dtype": lambda x, l, a, b: mok.moe(x, l, a, b, 2, topk_ids=torch.zeros(3, 2)),
    "weights shape": lambda x, l, a, b: mok.moe(x, l, a, b, 2, topk_ids=torch.zeros(3, 2, dtype=torch.int32),
                                                topk_weights=torch.ones(3, 1)),
    "device": lambda x, l, a, b: mok.moe(x.to("meta"), l.to("meta"), a.to("meta"), b.to("meta"), 2),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_raises_unsupported_error(case):
    x, logits, w13, w2 = make_inputs(3, 16, 8, 4)
    with pytest.raises(mok.UnsupportedError):
        BAD[case](x, logits, w13, w2)
