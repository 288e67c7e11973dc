"""mok.route / mok.moe on CUDA (Triton): rerun determinism, batch invariance, tile-config invariance of
every kernel, accuracy, gradients, routing replay, undefined routing. The other execution paths (scanned routes,
decode launch plans, the native decode, PDL, the schedule kernel): test_moe_gpu_paths.py; shared inputs and
configs: tests/helpers/moe_gpu.py. Run on the H200: `pytest -m gpu tests/mok/test_moe_gpu.py
tests/mok/test_moe_gpu_paths.py`."""
from __future__ import annotations

import pytest
import torch

import mok
from tests.helpers.moe_gpu import SHAPES, all_configs, digest, forward_backward, make_inputs
from tests.helpers.moe_plain import plain_moe_grouped, plain_route

pytestmark = pytest.mark.gpu


# ---------------------------------------------------------------------------------------------
# routing


@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (128, 8), (256, 8), (60, 4)])
def test_route_cuda_matches_reference_and_is_batch_invariant(num_experts, top_k):
    from mok.reference import moe as reference

    gen = torch.Generator(device="cuda").manual_seed(num_experts)
    logits = torch.randn(4096, num_experts, generator=gen, device="cuda") * 2
    logits[0] = 0.5
    logits[1, ::3] = 3.0
    ids, weights = mok.route(logits, top_k)
    ref_ids, ref_weights, _ = reference.route(logits.cpu(), top_k, True)
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(weights.cpu(), ref_weights, atol=1e-6, rtol=1e-5)
    assert ids[0].tolist() == list(range(top_k))
    for row in (0, 1, 17, 4095):
        ids1, weights1 = mok.route(logits[row:row + 1], top_k)
        assert torch.equal(ids1[0], ids[row]) and torch.equal(weights1[0], weights[row])
    perm = torch.randperm(4096, device="cuda")
    ids_p, weights_p = mok.route(logits[perm], top_k)
    assert torch.equal(ids_p, ids[perm]) and torch.equal(weights_p, weights[perm])
    from mok.ops.routing import replay_weights

    assert torch.equal(replay_weights(logits, ids), weights)


def _adversarial_logits(num_tokens, num_experts, seed):
    """Random logits with the rows routing must get right bit for bit: all tied, ties among the largest, -inf next
    to finite values, one NaN, one +inf, all -inf, and large spreads (sums of many tiny terms)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=gen, device="cuda") * 3
    logits[0::7] = 0.25
    logits[1::7, ::3] = 2.0
    logits[2::7, 1::2] = -float("inf")
    logits[3::29, -1] = float("nan")
    logits[4::31, 0] = float("inf")
    logits[5::37] = -float("inf")
    logits[6::7] *= 30
    return logits


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t


@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (60, 4), (64, 8), (128, 8), (256, 8)])
def test_routing_kernel_bits_do_not_depend_on_its_warps(num_experts, top_k):
    """The routing kernel launched with 1, 2, 4 and 8 warps gives the same ids, weights and probabilities, bit for
    bit (NaN rows too): its sums are pairwise_sum's fixed tree, so GEMM 1 (4 warps at decode, other counts under
    other configs) may run the same code and get its bits."""
    import triton

    from mok.kernels.moe.routing import _route_kernel, route_blocks

    logits = _adversarial_logits(4096, num_experts, seed=num_experts)
    results = []
    for warps in (1, 2, 4, 8):
        for replay in (False, True):
            ids = results[0][0].clone() if replay else torch.empty(4096, top_k, device="cuda", dtype=torch.int32)
            weights = torch.empty(4096, top_k, device="cuda")
            probs = torch.empty(4096, num_experts, device="cuda")
            _route_kernel[(4096,)](logits, ids, weights, probs, num_experts, logits.stride(0), TOP_K=top_k,
                                   RENORMALIZE=True, REPLAY=replay, PDL=False, num_warps=warps,
                                   **route_blocks(num_experts, top_k))
            results.append((ids, _bits(weights), _bits(probs)))
    assert triton.next_power_of_2(num_experts) == route_blocks(num_experts, top_k)["BLOCK_E"]
    for ids, weights, probs in results[1:]:
        assert torch.equal(ids, results[0][0]) and torch.equal(weights, results[0][1])
        assert torch.equal(probs, results[0][2])


# qwen3-like (16 tokens: the most slots the scan takes at K = 8), mixtral-like, odd E and K, 256 experts
@pytest.mark.parametrize("num_experts,top_k,num_tokens", [(128, 8, 16), (8, 2, 64), (6, 3, 42), (60, 4, 32),
                                                          (256, 8, 16)])
def test_routing_inside_gemm1_gives_the_routing_kernels_bits(num_experts, top_k, num_tokens, monkeypatch):
    """GEMM 1 routing a small batch itself (grouped_gemm._route_tokens, the kernel's ROUTE) writes the routing
    kernel's ids and weights bit for bit, over 2048+ adversarial rows (NaN / +inf / all -inf rows included) and
    both renormalisations, and computes the act rows of GEMM 1 given those ids; moe_infer routing inside GEMM 1
    equals moe_infer with the routing kernel, eager, under every tile config, and replayed from a CUDA graph."""
    from mok.kernels.moe import configs
    from mok.kernels.moe import layer as kernels
    from mok.kernels.moe.grouped_gemm import launch_gemm1
    from mok.kernels.moe.routing import launch_route
    from mok.kernels.moe.schedule import ScannedRoutes

    hidden, inter = 264, 100
    x, _, w13, w2 = make_inputs(num_tokens, hidden, inter, num_experts, seed=30)
    gemm1_config = configs.CONFIGS["decode"]["gemm1"]
    batches = -(-2048 // num_tokens)
    logits_all = _adversarial_logits(batches * num_tokens, num_experts, seed=31)
    for batch in range(batches):
        logits = logits_all[batch * num_tokens:(batch + 1) * num_tokens]
        for renormalize in (True, False):
            want_ids, want_weights, _ = launch_route(logits, top_k, renormalize)
            _, want_act = launch_gemm1(x, w13, ScannedRoutes(want_ids, num_experts), top_k, False, gemm1_config)
            ids = torch.full((num_tokens, top_k), -1, device="cuda", dtype=torch.int32)
            weights = torch.full((num_tokens, top_k), -1.0, device="cuda")
            _, act = launch_gemm1(x, w13, ScannedRoutes(ids, num_experts), top_k, False, gemm1_config,
                                  route=(logits, weights, renormalize))
            assert torch.equal(ids, want_ids) and torch.equal(_bits(weights), _bits(want_weights)), batch
            assert torch.equal(act.view(torch.int16), want_act.view(torch.int16)), batch
    monkeypatch.setattr(configs, "ROUTE_IN_GEMM1_MAX_TOKENS", 0)
    logits = logits_all[:num_tokens]
    apart = kernels.moe_infer(x, logits, w13, w2, None, None, top_k, True)
    monkeypatch.setattr(configs, "ROUTE_IN_GEMM1_MAX_TOKENS", num_tokens)
    # every tile config once (GEMM 1 with 2, 4 and 8 warps); the other sizes with today's
    for variant in [None, *(all_configs() if num_experts == 128 else [])]:
        inside = kernels.moe_infer(x, logits, w13, w2, None, None, top_k, True, variant)
        assert torch.equal(inside.view(torch.int16), apart.view(torch.int16)), variant
    x_static, logits_static = x.clone(), logits_all[num_tokens:2 * num_tokens].clone()
    kernels.moe_infer(x_static, logits_static, w13, w2, None, None, top_k, True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = kernels.moe_infer(x_static, logits_static, w13, w2, None, None, top_k, True)
    logits_static.copy_(logits)
    graph.replay()
    assert torch.equal(out_static.view(torch.int16), apart.view(torch.int16))


def test_route_cuda_gradient_matches_autograd():
    logits = torch.randn(64, 32, device="cuda")
    grad = torch.randn(64, 4, device="cuda")
    ours = logits.clone().requires_grad_()
    ids, weights = mok.route(ours, 4)
    weights.backward(grad)
    theirs = logits.double().requires_grad_()
    probs = torch.softmax(theirs, -1).gather(1, ids.long())
    (probs / probs.sum(-1, keepdim=True)).backward(grad.double())
    torch.testing.assert_close(ours.grad.double(), theirs.grad, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# determinism and batch invariance


@pytest.mark.parametrize("shape", ["qwen3-like", "mixtral-like"])
def test_rerun_determinism_20_forward_backward(shape):
    num_tokens, hidden, inter, num_experts, top_k = SHAPES[shape]
    inputs = make_inputs(num_tokens * 4, hidden, inter, num_experts, seed=1)
    grad_out = torch.randn(num_tokens * 4, hidden, device="cuda").bfloat16()
    digests = {digest(forward_backward(inputs, top_k, grad_out)) for _ in range(20)}
    assert len(digests) == 1, digests


@pytest.mark.parametrize("shape", ["qwen3-like", "mixtral-like"])
def test_batch_invariance_alone_batches_permuted_inference(shape):
    _, hidden, inter, num_experts, top_k = SHAPES[shape]
    pool = 8192 + 4
    x, logits, w13, w2 = make_inputs(pool, hidden, inter, num_experts, seed=2)
    probes = torch.tensor([0, 1, 2, 3], device="cuda")
    with torch.inference_mode():
        alone = torch.stack([mok.moe(x[p:p + 1], logits[p:p + 1], w13, w2, top_k)[0] for p in probes.tolist()])
    gen = torch.Generator(device="cuda").manual_seed(3)
    for extra in (1, 2, 7, 15, 63, 255, 1000, 4095, 8192):
        others = 4 + torch.randperm(pool - 4, generator=gen, device="cuda")[:extra]
        rows = torch.cat([probes, others])
        rows = rows[torch.randperm(rows.numel(), generator=gen, device="cuda")]
        where = torch.stack([(rows == p).nonzero()[0, 0] for p in probes])
        with torch.inference_mode():
            out = mok.moe(x[rows], logits[rows], w13, w2, top_k)
        assert torch.equal(out[where], alone), f"batch of {extra} others"
        if extra in (15, 4095):
            xg = x[rows].clone().requires_grad_()
            trained = mok.moe(xg, logits[rows], w13.clone().requires_grad_(), w2, top_k)
            assert torch.equal(trained.detach()[where], alone), f"training forward, {extra} others"


@pytest.mark.parametrize("shape", ["qwen3-like", "mixtral-like"])
def test_every_decode_batch_1_to_128_gives_the_prefill_rows(shape):
    """Each decode batch T = 1..128 (the schedule kernels, the decode or small tiles), at the start of the batch
    and at an offset, gives the bits of the same tokens inside a T = 4096 prefill (the torch schedule, the large
    tiles), eager and replayed from a CUDA graph."""
    _, hidden, inter, num_experts, top_k = SHAPES[shape]
    x, logits, w13, w2 = make_inputs(4096, hidden, inter, num_experts, seed=4)
    with torch.inference_mode():
        full = mok.moe(x, logits, w13, w2, top_k)
        for num_tokens in range(1, 129):
            for start in (0, 1000):
                rows = slice(start, start + num_tokens)
                assert torch.equal(mok.moe(x[rows], logits[rows], w13, w2, top_k), full[rows]), (num_tokens, start)
    x_static, logits_static = x[:8].clone(), logits[:8].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.inference_mode():
        mok.moe(x_static, logits_static, w13, w2, top_k)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.inference_mode():
        out_static = mok.moe(x_static, logits_static, w13, w2, top_k)
    for start in (100, 2000):
        x_static.copy_(x[start:start + 8])
        logits_static.copy_(logits[start:start + 8])
        graph.replay()
        assert torch.equal(out_static, full[start:start + 8]), start


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_kernel_is_tile_config_invariant(shape):
    """Each kernel (GEMM 1 + SwiGLU, GEMM 2, combine; backward GEMMs, weight grads, combine
    backward) gives bit-identical results under every tile config: why the config may follow T."""
    from mok.kernels.moe import layer as kernels

    num_tokens, hidden, inter, num_experts, top_k = SHAPES[shape]
    x, logits, w13, w2 = make_inputs(num_tokens, hidden, inter, num_experts, seed=4)
    ids, weights = mok.route(logits, top_k)
    grad_out = torch.randn(num_tokens, hidden, device="cuda").bfloat16()
    results = []
    for configs in all_configs():
        fwd = kernels.moe_forward(x, w13, w2, ids, weights, True, configs)
        bwd = kernels.moe_backward(grad_out, x, w13, w2, ids, weights, *fwd[1:], configs=configs)
        results.append([*fwd, *bwd])
    labels = ["out", "gate_up", "act", "y", "sorted_slots", "expert_start", "d hidden", "d w13", "d w2", "d weights"]
    for variant in results[1:]:
        for label, a, b in zip(labels, results[0], variant):
            assert torch.equal(a, b), label


# (T, H, I, E, K) where an epilogue offset passes 2^31: d gate_up / gate_up of T * K * 2I elements (bwd_act), y and
# the per-slot d hidden of T * K * H (GEMM 2, bwd_dx)
PAST_INT32 = {"gate_up past 2^31": (131072, 64, 1024, 64, 8), "y past 2^31": (131072, 2048, 64, 64, 8)}


@pytest.mark.parametrize("shape", sorted(PAST_INT32))
def test_lean_epilogue_row_bases_past_int32_offsets(shape):
    """The lean epilogue where int32 offsets would wrap (the launcher turns LEAN_EPILOGUE 1 into 2 there: int64 row
    bases, int32 columns): every output of the forward and the backward equals the plain epilogue's."""
    from mok.kernels.moe import layer as kernels
    from mok.kernels.moe.configs import CONFIGS

    num_tokens, hidden, inter, num_experts, top_k = PAST_INT32[shape]
    assert num_tokens * top_k * max(2 * inter, hidden) >= 2 ** 31
    x, logits, w13, w2 = make_inputs(num_tokens, hidden, inter, num_experts, seed=6)
    ids, weights = mok.route(logits, top_k)
    grad_out = torch.randn(num_tokens, hidden, device="cuda").bfloat16()
    results = []
    for lean in (0, 1):
        configs = {name: dict(CONFIGS["large"][name], LEAN_EPILOGUE=lean) for name in ("gemm2", "bwd_act", "bwd_dx")}
        fwd = kernels.moe_forward(x, w13, w2, ids, weights, True, configs)
        bwd = kernels.moe_backward(grad_out, x, w13, w2, ids, weights, *fwd[1:], configs=configs)
        results.append([*fwd, *bwd])
    labels = ["out", "gate_up", "act", "y", "sorted_slots", "expert_start", "d hidden", "d w13", "d w2", "d weights"]
    for label, lean, plain in zip(labels, results[1], results[0]):
        assert torch.equal(lean, plain), label


# ---------------------------------------------------------------------------------------------
# accuracy, gradients, replay


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_forward_accuracy_against_fp32(shape):
    num_tokens, hidden, inter, num_experts, top_k = SHAPES[shape]
    x, logits, w13, w2 = make_inputs(num_tokens, hidden, inter, num_experts, seed=5)
    out = mok.moe(x, logits, w13, w2, top_k)
    same_rounding = plain_moe_grouped(x, logits, w13, w2, top_k)
    fp32 = plain_moe_grouped(x, logits, w13, w2, top_k, rounded=False)
    scale = fp32.abs().max().item()
    torch.testing.assert_close(out.float(), same_rounding.float(), atol=1e-2 * scale, rtol=1e-2)
    torch.testing.assert_close(out.float(), fp32, atol=2e-2 * scale, rtol=2e-2)
    # the CPU reference path: same semantics (not the same bits: docs/contracts.md, "Bitwise")
    if shape == "odd":
        cpu = mok.moe(x.cpu(), logits.cpu(), w13.cpu(), w2.cpu(), top_k)
        torch.testing.assert_close(out.cpu().float(), cpu.float(), atol=1e-2 * scale, rtol=1e-2)


@pytest.mark.parametrize("shape", ["odd", "qwen3-like"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_gradients_against_autograd_of_reference(shape, renormalize):
    num_tokens, hidden, inter, num_experts, top_k = SHAPES[shape]
    inputs = make_inputs(num_tokens, hidden, inter, num_experts, seed=6)
    grad_out = torch.randn(num_tokens, hidden, device="cuda").bfloat16()
    ours = forward_backward(inputs, top_k, grad_out, renormalize)
    leaves = [t.clone().requires_grad_() for t in inputs]
    plain_moe_grouped(*leaves, top_k, renormalize).backward(grad_out)
    for label, a, b in zip(("hidden", "logits", "w13", "w2"), ours[1:], [t.grad for t in leaves]):
        scale = b.abs().max().item()
        assert a.dtype == b.dtype, label
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2 * scale, rtol=2e-2, msg=label)


def test_topk_weights_gradient_cuda():
    num_tokens, hidden, inter, num_experts, top_k = SHAPES["odd"]
    x, logits, w13, w2 = make_inputs(num_tokens, hidden, inter, num_experts, seed=7)
    ids, weights = plain_route(logits, top_k)
    grad_out = torch.randn(num_tokens, hidden, device="cuda").bfloat16()
    ours = weights.detach().clone().requires_grad_()
    mok.moe(x, logits, w13, w2, top_k, topk_ids=ids.int(), topk_weights=ours).backward(grad_out)
    theirs = weights.detach().clone().requires_grad_()
    plain_moe_grouped(x, logits, w13, w2, top_k, topk_ids=ids, topk_weights=theirs).backward(grad_out)
    scale = theirs.grad.abs().max().item()
    torch.testing.assert_close(ours.grad, theirs.grad, atol=2e-2 * scale, rtol=2e-2)


@pytest.mark.parametrize("renormalize", [True, False])
def test_replay_equals_routing_cuda(renormalize):
    num_tokens, hidden, inter, num_experts, top_k = SHAPES["qwen3-like"]
    x, logits, w13, w2 = make_inputs(num_tokens, hidden, inter, num_experts, seed=8)
    out = mok.moe(x, logits, w13, w2, top_k, renormalize)
    ids, weights = mok.route(logits, top_k, renormalize)
    assert torch.equal(mok.moe(x, logits, w13, w2, top_k, renormalize, topk_ids=ids, topk_weights=weights), out)
    assert torch.equal(mok.moe(x, logits, w13, w2, top_k, renormalize, topk_ids=ids.long()), out)


def test_module_and_compile_cuda():
    torch.manual_seed(0)
    layer = mok.MoE(512, 256, 8, 2, device="cuda")
    x = torch.randn(33, 512, device="cuda").bfloat16()
    eager = layer(x)
    compiled = torch.compile(layer, fullgraph=False)(x)
    assert torch.equal(eager, compiled)
    compiled.float().sum().backward()
    assert all(p.grad is not None for p in layer.parameters())


# ---------------------------------------------------------------------------------------------
# undefined routing and out-of-range replay ids (docs/contracts.md, "Routing")


def _spoil(logits, token, how):
    logits = logits.clone()
    if how == "nan":
        logits[token, 1] = float("nan")
    elif how == "+inf":
        logits[token, 0] = float("inf")
    else:  # every logit -inf
        logits[token] = -float("inf")
    return logits


@pytest.mark.parametrize("how", ["nan", "+inf", "-inf"])
@pytest.mark.parametrize("mode", ["route", "replay ids", "replay ids and weights"])
@pytest.mark.parametrize("num_tokens", [5, 300])  # scan / schedule kernel; the torch schedule (limit 2048 slots)
def test_undefined_routing_row_is_nan_others_keep_their_bits_cuda(how, mode, num_tokens, monkeypatch):
    from mok.kernels.moe import configs

    monkeypatch.setattr(configs, "SCHEDULE_KERNEL_MAX_SLOTS", 2048)
    _, hidden, inter, num_experts, top_k = SHAPES["qwen3-like"]
    x, logits, w13, w2 = make_inputs(num_tokens, hidden, inter, num_experts, seed=20)
    bad_token = num_tokens // 2
    keep = [t for t in range(num_tokens) if t != bad_token]
    bad = _spoil(logits, bad_token, how)
    ids, weights = mok.route(bad, top_k)
    assert ids[bad_token].tolist() == list(range(top_k)) and bool(weights[bad_token].isnan().all())
    clean_ids, clean_weights = mok.route(logits[keep], top_k)
    assert torch.equal(ids[keep], clean_ids) and torch.equal(weights[keep], clean_weights)
    kwargs = {"route": {}, "replay ids": {"topk_ids": ids},
              "replay ids and weights": {"topk_ids": ids, "topk_weights": weights}}[mode]
    with torch.inference_mode():
        outs = [mok.moe(x, bad, w13, w2, top_k, **kwargs) for _ in range(3)]
        clean = mok.moe(x[keep], logits[keep], w13, w2, top_k)
    assert all(torch.equal(o.view(torch.int16), outs[0].view(torch.int16)) for o in outs[1:])  # NaN bits too
    out = outs[0]
    assert bool(out[bad_token].isnan().all())
    assert torch.equal(out[keep], clean)
    assert all(torch.equal(o[keep], clean) for o in outs[1:])
    # training forward and backward run without error
    leaves = [t.clone().requires_grad_() for t in (x, bad, w13, w2)]
    trained = mok.moe(*leaves, top_k)
    assert torch.equal(trained.detach()[keep], clean)
    trained.float()[keep].sum().backward()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("num_tokens", [6, 400])  # the scanned routes; the torch schedule (limit 2048 slots)
def test_out_of_range_replay_ids_give_nan_rows_without_race_cuda(dtype, num_tokens, monkeypatch):
    """An id outside [0, E) in topk_ids on CUDA: no host check there, so the device neutralises the token
    (experts 0..K-1, NaN weights): its row is NaN, the others keep the bits of the batch without it, every
    rerun gives the same bits (no colliding writes, no uninitialised reads)."""
    from mok.kernels.moe import configs

    monkeypatch.setattr(configs, "SCHEDULE_KERNEL_MAX_SLOTS", 2048)
    _, hidden, inter, num_experts, top_k = SHAPES["qwen3-like"]
    x, logits, w13, w2 = make_inputs(num_tokens, hidden, inter, num_experts, seed=21)
    ids, weights = mok.route(logits, top_k)
    wrong = {1: (0, -1), 3: (top_k - 1, num_experts), 4: (2, 2 ** 32 if dtype == torch.int64 else 2 ** 31 - 1)}
    keep = [t for t in range(num_tokens) if t not in wrong]
    given = ids.to(dtype).clone()
    for t, (k, value) in wrong.items():
        given[t, k] = value
    from mok.ops.routing import replay_weights

    replayed = replay_weights(logits, given)
    assert bool(replayed[list(wrong)].isnan().all()) and torch.equal(replayed[keep], weights[keep])
    with torch.inference_mode():
        clean = mok.moe(x[keep], logits[keep], w13, w2, top_k)
        for kwargs in ({"topk_ids": given}, {"topk_ids": given, "topk_weights": weights}):
            outs = [mok.moe(x, logits, w13, w2, top_k, **kwargs) for _ in range(5)]
            assert all(torch.equal(o.view(torch.int16), outs[0].view(torch.int16)) for o in outs[1:])
            for out in outs:
                for t in wrong:
                    assert bool(out[t].isnan().all()), (kwargs.keys(), t)
                assert torch.equal(out[keep], clean), kwargs.keys()
