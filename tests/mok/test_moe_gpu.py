"""mok.route / mok.moe on CUDA (Triton): rerun determinism, batch invariance, tile-config invariance of
every kernel, accuracy, gradients, routing replay. Run on the H200: `pytest -m gpu tests/mok/test_moe_gpu.py`."""
from __future__ import annotations

import hashlib

import pytest
import torch

import mok
from tests.helpers.moe_plain import plain_moe_grouped, plain_route

pytestmark = pytest.mark.gpu

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
    for variant in [None, *(_all_configs() if num_experts == 128 else [])]:
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


def _all_configs():
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
    for configs in _all_configs():
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


# one token; the most slots the scan takes (qwen3: 16 x 8; mixtral: 64 x 2, experts of several 16-row tiles); odd K
@pytest.mark.parametrize("shape,num_tokens", [("qwen3-like", 1), ("qwen3-like", 16), ("mixtral-like", 64), ("odd", 5)])
def test_scanned_routes_equal_the_schedule_under_every_config(shape, num_tokens, monkeypatch):
    """moe_infer's small batches let GEMM 1 and GEMM 2 scan the ids (ScannedRoutes) instead of building a
    schedule: the schedule path's bits under every tile config (the test above ties those to every config of
    the schedule path, test_every_decode_batch_1_to_128_gives_the_prefill_rows to the prefill's rows)."""
    from mok.kernels.moe import configs
    from mok.kernels.moe import layer as kernels
    from mok.kernels.moe.schedule import scans_routes

    _, hidden, inter, num_experts, top_k = SHAPES[shape]
    assert scans_routes(num_tokens * top_k)
    x, logits, w13, w2 = make_inputs(num_tokens, hidden, inter, num_experts, seed=5)
    ids, weights = mok.route(logits, top_k)
    scanned = kernels.moe_infer(x, logits, w13, w2, ids, weights, top_k, True)
    with monkeypatch.context() as patch:
        patch.setattr(configs, "SCAN_MAX_SLOTS", 0)
        assert torch.equal(kernels.moe_infer(x, logits, w13, w2, ids, weights, top_k, True), scanned)
    assert torch.equal(kernels.moe_infer(x, logits, w13, w2, None, None, top_k, True), scanned)
    for variant in _all_configs():
        assert torch.equal(kernels.moe_infer(x, logits, w13, w2, ids, weights, top_k, True, variant), scanned), variant


@pytest.mark.parametrize("shape", ["qwen3-like", "odd"])
def test_decode_plans_replay_the_bits_of_unplanned_calls(shape, monkeypatch):
    """moe_infer's decode calls replay the launches of the first call with their key (layer.decode_plans, a
    PlanCache of mok/kernels/launch.py) with their own tensors' addresses, the weights' included: routed, replayed
    ids (int32 and int64) and given weights, scanned routes and a schedule, at several offsets into the batch, x
    misaligned (a plan of its own), a second layer's weights (the same plan) and a side stream (a plan of its
    own), every call gives the bits of the same call unplanned; each key's first call builds a plan, every later
    one replays it, except int64 ids through a schedule (a torch cast before the sort kernel: no plan, remembered
    as None); a changed setting of configs.py is a new key; a replay allocates only its output."""
    from mok.kernels import launch
    from mok.kernels.moe import configs
    from mok.kernels.moe import layer as kernels
    from mok.kernels.moe.schedule import scans_routes

    _, hidden, inter, num_experts, top_k = SHAPES[shape]
    x, logits, w13, w2 = make_inputs(600, hidden, inter, num_experts, seed=7)
    _, _, w13_b, w2_b = make_inputs(1, hidden, inter, num_experts, seed=8)  # a second layer
    replays, real_launch = [], launch.LaunchPlan.launch
    monkeypatch.setattr(launch.LaunchPlan, "launch", lambda plan, per_call: (replays.append(plan),
                                                                               real_launch(plan, per_call)))

    def planned(*args):
        return kernels.moe_infer(*args, plan=True)

    kernels.decode_plans.clear()
    scanned_and_not = (1, 3, 16, 40) if shape == "qwen3-like" else (1, 5, 43, 60)
    assert {scans_routes(num_tokens * top_k) for num_tokens in scanned_and_not} == {True, False}
    with torch.inference_mode():
        for num_tokens in scanned_and_not:
            misaligned = x.view(-1)[1:1 + num_tokens * hidden].view(num_tokens, hidden)
            for mode in ("route", "replay int32", "replay int64", "weights"):
                before = len(replays)
                for x_rows, start, layer_weights in [(x[start:start + num_tokens], start, (w13, w2))
                                                     for start in (0, 100, 200)] + [
                        (misaligned, 0, (w13, w2)), (misaligned, 300, (w13, w2)),
                        (x[400:400 + num_tokens], 400, (w13_b, w2_b))]:
                    logits_rows = logits[start:start + num_tokens]
                    ids, weights = mok.route(logits_rows, top_k)
                    ids = ids.long() if mode == "replay int64" else ids
                    args = (x_rows, logits_rows, *layer_weights, None if mode == "route" else ids,
                            weights if mode == "weights" else None, top_k, True)
                    assert torch.equal(planned(*args), kernels.moe_infer(*args)), (num_tokens, mode, start)
                refused = mode == "replay int64" and not scans_routes(num_tokens * top_k)
                assert len(replays) - before == (0 if refused else 4), (num_tokens, mode)  # 2 keys built per block
                plans = kernels.decode_plans.plans
                assert (plans[next(reversed(plans))] is None) == refused
        assert len(kernels.decode_plans.plans) == kernels.decode_plans.capacity == 16  # 32 keys used: the last 16 kept
        args = (x[:3], logits[:3], w13, w2, None, None, top_k, True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            before = len(replays)
            on_side = [planned(*args) for _ in range(2)]
            assert len(replays) == before + 1  # its own plan: built, then replayed
        torch.cuda.current_stream().wait_stream(side)
        assert torch.equal(on_side[0], kernels.moe_infer(*args)) and torch.equal(on_side[1], on_side[0])
        planned(*args)  # this key's plan (on the current stream)
        before = len(replays)
        with monkeypatch.context() as patch:
            patch.setattr(configs, "SCAN_MAX_SLOTS", 0)  # the schedule path instead of the scan: another key
            assert torch.equal(planned(*args), on_side[0]) and len(replays) == before
        real_empty, allocations = torch.empty, []
        monkeypatch.setattr(torch, "empty", lambda *a, **k: (allocations.append(a), real_empty(*a, **k))[1])
        planned(*args)
        assert len(allocations) == 1 and len(replays) == before + 1, allocations  # the output


@pytest.mark.parametrize("shape", ["qwen3-like", "odd"])
def test_native_moe_decode_gives_the_bits_of_the_python_path(shape, monkeypatch):
    """mok.moe's plain eager inference calls on the native path (mok/kernels/native: the plan replayed from C++, the
    workspace held there): routed, replayed ids (int32 and int64) and given weights, scanned routes and a schedule,
    x misaligned, a second layer's weights (the same key), a side stream (a key of its own), a prefill size (no
    plan), plans off (decode_plans.capacity 0), a changed PDL setting (another key) and a call under CUDA-graph
    capture (unplanned, replayed by the graph): every output has the bits of the Python path's call, twice over,
    and the decode keys get plans that later calls replay (but int64 ids through a schedule: a torch cast, no plan).
    The native table keeps decode_plans.capacity keys, the least recently used going first, and decode_plans.clear()
    reaches it (the next call records anew)."""
    from mok.kernels import launch, native
    from mok.kernels.moe import layer as kernels
    from mok.kernels.moe.schedule import scans_routes

    assert native.load() is not None
    native.clear()
    monkeypatch.setattr(kernels.decode_plans, "capacity", 64)  # room for every key below (the native table follows it)
    _, hidden, inter, num_experts, top_k = SHAPES[shape]
    prefill = kernels.DECODE_PLAN_MAX_BYTES // (top_k * (inter + hidden) * 2) + 1  # the fewest tokens past the limit
    x, logits, w13, w2 = make_inputs(max(600, prefill), hidden, inter, num_experts, seed=7)
    _, _, w13_b, w2_b = make_inputs(1, hidden, inter, num_experts, seed=8)
    sizes = (1, 3, 40) if shape == "qwen3-like" else (1, 5, 60)
    assert {scans_routes(n * top_k) for n in sizes} == {True, False}

    def cases():
        for num_tokens in sizes:
            misaligned = x.view(-1)[1:1 + num_tokens * hidden].view(num_tokens, hidden)
            for mode in ("route", "replay int32", "replay int64", "weights"):
                for x_rows, start, layer in [(x[:num_tokens], 0, (w13, w2)), (x[100:100 + num_tokens], 100, (w13, w2)),
                                             (misaligned, 0, (w13, w2)), (x[400:400 + num_tokens], 400, (w13_b, w2_b))]:
                    logits_rows = logits[start:start + num_tokens]
                    ids, weights = mok.route(logits_rows, top_k)
                    ids = ids.long() if mode == "replay int64" else ids
                    yield (x_rows, logits_rows, *layer, top_k, True, None if mode == "route" else ids,
                           weights if mode == "weights" else None)
        yield (x[:prefill], logits[:prefill], w13, w2, top_k, True, None, None)  # past DECODE_PLAN_MAX_BYTES: no plan

    def outputs():
        with torch.inference_mode():
            return [mok.moe(*args) for args in cases()]

    native.ENABLED = False
    try:
        want = outputs()
    finally:
        native.ENABLED = True
    _, _, records_before, found_before = native.stats()
    for _ in range(2):
        got = outputs()
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    keys, unplanned, records, found = native.stats()
    refused = 2 * sum(not scans_routes(n * top_k) for n in sizes)  # int64 ids through a schedule (x aligned or not)
    assert (keys, unplanned, records - records_before) == (3 * 4 * 2, refused, 3 * 4 * 2)  # (x aligned or not)
    assert found - found_before == 2 * 3 * 4 * 4 - keys
    args = (x[:3], logits[:3], w13, w2, top_k)
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            on_side = [mok.moe(*args) for _ in range(2)]
        torch.cuda.current_stream().wait_stream(side)
        assert native.stats()[2] == records + 1  # the side stream's key, recorded once
        on_current = mok.moe(*args)
        assert all(torch.equal(out, on_current) for out in on_side)
        monkeypatch.setattr(kernels.decode_plans, "capacity", 0)
        records = native.stats()[2]
        assert torch.equal(mok.moe(x[:2], logits[:2], w13, w2, top_k), mok.moe(x[:2], logits[:2], w13, w2, top_k))
        assert native.stats()[2] == records  # plans off: nothing recorded
        monkeypatch.setattr(kernels.decode_plans, "capacity", 64)
        monkeypatch.setattr(launch, "PDL_ENABLED", not launch.PDL_ENABLED)
        without = mok.moe(*args)
        assert native.stats()[2] == records + 1 and torch.equal(without, on_side[0])
        monkeypatch.setattr(launch, "PDL_ENABLED", not launch.PDL_ENABLED)
        x_static = x[200:202].clone()
        graph = torch.cuda.CUDAGraph()
        mok.moe(x_static, logits[:2], w13, w2, top_k)  # warm
        records = native.stats()[2]
        with torch.cuda.graph(graph):
            captured = mok.moe(x_static, logits[:2], w13, w2, top_k)
        assert native.stats()[2] == records  # under capture: unplanned
        captured.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, mok.moe(x_static, logits[:2], w13, w2, top_k))
        monkeypatch.setattr(kernels.decode_plans, "capacity", 2)
        for num_tokens in (1, 2, 3):
            mok.moe(x[:num_tokens], logits[:num_tokens], w13, w2, top_k)
        assert native.stats()[0] == 2  # the least recently used key went
        records = native.stats()[2]
        kernels.decode_plans.clear()  # (after changing configs.py's dicts): the native plans are not used again
        after_clear = [mok.moe(x[:3], logits[:3], w13, w2, top_k) for _ in range(2)]
        assert native.stats()[2] == records + 1  # recorded anew, then replayed
        monkeypatch.setattr(native, "ENABLED", False)
        assert all(torch.equal(out, mok.moe(x[:3], logits[:3], w13, w2, top_k)) for out in after_clear)


@pytest.mark.parametrize("shape,num_tokens", [("qwen3-like", 1), ("qwen3-like", 16), ("mixtral-like", 64),
                                              ("odd", 5), ("qwen3-like", 512), ("odd", 123)])
def test_programmatic_dependent_launch_gives_the_bits_of_plain_launches(shape, num_tokens, monkeypatch):
    """Routing, GEMM 1, GEMM 2 and the combine launch with PDL (mok/kernels/launch.py): each may start while
    the kernel before it runs and waits for it on the device. Turning PDL off gives the same bits: the
    forward (decode through the scan, prefill through the schedule), replayed from a CUDA graph with new
    inputs copied in between without a host synchronisation (each replay's routes differ from the last, so a
    GEMM 2 computing from stale ids would show), and forward+backward (the backward's grouped GEMMs launch
    with PDL)."""
    from mok.kernels import launch

    _, hidden, inter, num_experts, top_k = SHAPES[shape]
    inputs = make_inputs(num_tokens, hidden, inter, num_experts, seed=6)
    grad_out = torch.randn(num_tokens, hidden, device="cuda").bfloat16()
    seeds = (7, 8, 9, 10)
    others = [make_inputs(num_tokens, hidden, inter, num_experts, seed=seed)[:2] for seed in seeds]
    assert launch.pdl_options(inputs[0].device)["PDL"], "the H200 launches with PDL"

    def run_all():
        with torch.inference_mode():
            eager = [mok.moe(*inputs, top_k)] + [mok.moe(x, logits, *inputs[2:], top_k) for x, logits in others]
        static = [t.clone() for t in inputs[:2]]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            mok.moe(*static, *inputs[2:], top_k)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.inference_mode():
            out_static = mok.moe(*static, *inputs[2:], top_k)
        replays = []
        for x, logits in [inputs[:2], *others, inputs[:2]]:
            static[0].copy_(x)
            static[1].copy_(logits)
            graph.replay()
            replays.append(out_static.clone())
        assert all(torch.equal(got, want) for got, want in zip(replays, eager + eager[:1], strict=True))
        return [*eager, *replays, *forward_backward(inputs, top_k, grad_out)]

    with_pdl = run_all()
    monkeypatch.setattr(launch, "PDL_ENABLED", False)
    assert not launch.pdl_options(inputs[0].device)["PDL"]
    without_pdl = run_all()
    labels = [f"eager {i}" for i in range(5)] + [f"replay {i}" for i in range(6)] + ["out", "d x", "d logits",
                                                                                    "d w13", "d w2"]
    for label, a, b in zip(labels, with_pdl, without_pdl, strict=True):
        assert torch.equal(a, b), label


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 128, 8), (3, 8, 2), (123, 6, 3), (256, 256, 8),
                                                         (16384, 8, 2), (16384, 128, 8), (16384, 256, 8)])
def test_schedule_kernel_equals_torch_schedule(num_tokens, num_experts, top_k, monkeypatch):
    """The kernel-built schedule gives the torch path's integers (so it changes no bits), from one token to the
    training batches it serves (T = 16384: up to configs.SCHEDULE_KERNEL_MAX_SLOTS slots)."""
    from mok.kernels.moe import configs
    from mok.kernels.moe.schedule import Schedule

    logits = torch.randn(num_tokens, num_experts, device="cuda")
    ids, _ = mok.route(logits, top_k)
    fast = Schedule(ids, num_experts, block_m=16)
    assert fast._use_kernel
    monkeypatch.setattr(configs, "SCHEDULE_KERNEL_MAX_SLOTS", 0)
    slow = Schedule(ids, num_experts)
    assert torch.equal(fast.sorted_slots_N, slow.sorted_slots_N) and torch.equal(fast.expert_start, slow.expert_start)
    for block_m in (16, 64):
        got, want = fast.tiles(block_m), slow.tiles(block_m)
        assert got[3] == want[3] and all(torch.equal(a, b) for a, b in zip(got[:3], want[:3])), block_m
    monkeypatch.setattr(configs, "SCHEDULE_KERNEL_MAX_SLOTS", num_tokens * top_k)
    given = Schedule(ids, num_experts, slow.sorted_slots_N.long(), slow.expert_start.long())
    assert given._use_kernel and all(torch.equal(a, b) for a, b in zip(given.tiles(16)[:3], slow.tiles(16)[:3]))


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
