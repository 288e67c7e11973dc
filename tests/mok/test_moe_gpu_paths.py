"""mok.moe's other execution paths on CUDA give the bits of the plain one: small batches scanning their routes
instead of a schedule (under every tile config), the decode calls' launch plans and the native decode path,
programmatic dependent launch, the one-launch schedule kernel. Run on the H200:
`pytest -m gpu tests/mok/test_moe_gpu_paths.py`."""
from __future__ import annotations

import pytest
import torch

import mok
from tests.helpers.moe_gpu import SHAPES, all_configs, forward_backward, make_inputs

pytestmark = pytest.mark.gpu


# one token; the most slots the scan takes (qwen3: 16 x 8; mixtral: 64 x 2, experts of several 16-row tiles); odd K
@pytest.mark.parametrize("shape,num_tokens", [("qwen3-like", 1), ("qwen3-like", 16), ("mixtral-like", 64), ("odd", 5)])
def test_scanned_routes_equal_the_schedule_under_every_config(shape, num_tokens, monkeypatch):
    """moe_infer's small batches let GEMM 1 and GEMM 2 scan the ids (ScannedRoutes) instead of building a
    schedule: the schedule path's bits under every tile config (test_moe_gpu.py's tile-config test ties those to every
    config of the schedule path, test_every_decode_batch_1_to_128_gives_the_prefill_rows to the prefill's rows)."""
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
    for variant in all_configs():
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
