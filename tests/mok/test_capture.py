"""Capture without host synchronisation: every mok op, and a wrapped decoder layer, traced by
torch.compile(fullgraph=True), captured in CUDA graphs, and run with torch's sync detector armed.

CPU (CI): torch.compile(fullgraph=True, backend="aot_eager") over the CPU reference paths (the custom ops'
fake impls and autograd registrations trace with no graph break) gives the eager bits, forward and
backward; the no-grad MoE forward is the one-dispatch `mok::moe_infer`; out-of-range logprobs ids give
NaN under compile. Interpreter cases (TRITON_INTERPRET=1, one child process, like test_moe_interpret.py)
run the CUDA code paths on CPU tensors: `moe_infer` gives the bits of route + moe_forward with two
allocations, the logprobs kernel and CUDA backward give NaN for out-of-range ids, the device inv_freq
of rotary equals the host's.
GPU (marker gpu): CUDA-graph capture + replay (with new inputs) equals eager bitwise for mok.moe forward
and forward+backward, every dense op and a wrapped Qwen3-MoE decoder layer; torch.compile(fullgraph=True)
(inductor) of the MoE layer and of the decoder layer equals eager; torch.cuda.set_sync_debug_mode("error")
around the eager forward and backward of every op proves that none synchronises. Run on the H200:
`python3 -m pytest -q -m gpu tests/mok/test_capture.py`.
"""
from __future__ import annotations

import contextlib
import sys

import pytest

from tests.helpers.bits import same_bits
from tests.helpers.interpret import Cases, run_cases

CASES = Cases()
case = CASES.case

# (T, H, I, E, K) of the interpreter cases: one decode token, odd sizes, more experts than tokens
INTERPRET_SHAPES = [(1, 64, 32, 16, 4), (7, 40, 24, 6, 3), (3, 64, 32, 16, 4)]


def _moe_inputs(num_tokens, hidden, inter, num_experts, seed=0, device="cpu", dtype=None):
    import torch

    dtype = dtype or torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen, device=device).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen, device=device)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=device) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen, device=device) / inter ** 0.5).to(dtype)
    return x, logits, w13, w2


# ---------------------------------------------------------------------------------------------
# interpreter cases (run in the child)


@contextlib.contextmanager
def _count_allocations():
    """Counts torch.empty calls (every allocation of the MoE launchers and the schedule goes through it)."""
    import torch

    calls = []
    real_empty = torch.empty

    def counting_empty(*args, **kwargs):
        calls.append(args)
        return real_empty(*args, **kwargs)

    torch.empty = counting_empty
    try:
        yield calls
    finally:
        torch.empty = real_empty


@case
def moe_infer_equals_route_then_moe_forward_bitwise():

    from mok.kernels.moe import configs
    from mok.kernels.moe import layer as kernels

    for shape in INTERPRET_SHAPES:
        num_tokens, hidden, inter, num_experts, top_k = shape
        x, logits, w13, w2 = _moe_inputs(num_tokens, hidden, inter, num_experts, seed=num_tokens)
        for max_slots in (configs.SCHEDULE_KERNEL_MAX_SLOTS, 0):  # the schedule kernel, and the torch schedule
            saved = configs.SCHEDULE_KERNEL_MAX_SLOTS
            configs.SCHEDULE_KERNEL_MAX_SLOTS = max_slots
            try:
                for renormalize in (True, False):
                    ids, weights, _ = kernels.route(logits, top_k, renormalize)
                    want = kernels.moe_forward(x, w13, w2, ids, weights, False)[0]
                    assert same_bits(want, kernels.moe_forward(x, w13, w2, ids, weights, True)[0])
                    routed = kernels.moe_infer(x, logits, w13, w2, None, None, top_k, renormalize)
                    replayed = kernels.moe_infer(x, logits, w13, w2, ids.long(), None, top_k, renormalize)
                    given = kernels.moe_infer(x, logits, w13, w2, ids, weights, top_k, renormalize)
                    for label, got in (("route", routed), ("replay ids", replayed), ("replay both", given)):
                        assert same_bits(got, want), (shape, max_slots, renormalize, label)
            finally:
                configs.SCHEDULE_KERNEL_MAX_SLOTS = saved


@case
def moe_infer_allocates_a_workspace_and_the_output_only():
    """One workspace and the output per call (CPU tensors: no launch plans, mok/kernels/launch.py; the plans'
    allocations are checked on the GPU, tests/mok/test_moe_gpu.py)."""
    import torch

    from mok.kernels.moe import layer as kernels

    num_tokens, hidden, inter, num_experts, top_k = INTERPRET_SHAPES[0]
    x, logits, w13, w2 = _moe_inputs(num_tokens, hidden, inter, num_experts, seed=3)
    want = kernels.moe_infer(x, logits, w13, w2, None, None, top_k, True)
    for _ in range(2):
        with _count_allocations() as calls:
            out = kernels.moe_infer(x, logits, w13, w2, None, None, top_k, True)
        assert len(calls) == 2, calls  # the uint8 workspace, out [T, H]
        assert same_bits(out, want)
    assert not kernels.decode_plans.plans
    ids, weights, _ = kernels.route(logits, top_k, True)
    with _count_allocations() as calls:
        kernels.moe_forward(x, w13, w2, ids, weights, False)
    assert len(calls) > 2, calls  # the path it replaces allocates each piece
    assert out.shape == (num_tokens, hidden) and out.dtype == torch.bfloat16


@case
def moe_infer_neutralises_undefined_and_out_of_range_tokens_like_moe_forward():

    from mok.kernels.moe import layer as kernels

    num_tokens, hidden, inter, num_experts, top_k = INTERPRET_SHAPES[1]
    x, logits, w13, w2 = _moe_inputs(num_tokens, hidden, inter, num_experts, seed=5)
    logits[2, 1] = float("nan")  # undefined routing
    ids, weights, _ = kernels.route(logits, top_k, True)
    bad_ids = ids.long().clone()
    bad_ids[4, 0] = num_experts
    bad_ids[5, 2] = -7
    for ids_given, weights_given in ((None, None), (bad_ids, None), (bad_ids, weights)):
        got = kernels.moe_infer(x, logits, w13, w2, ids_given, weights_given, top_k, True)
        if ids_given is None:
            want = kernels.moe_forward(x, w13, w2, ids, weights, False)[0]
        elif weights_given is None:
            want = kernels.moe_forward(x, w13, w2, bad_ids, kernels.replay_weights(logits, bad_ids, True)[0], False)[0]
        else:
            want = kernels.moe_forward(x, w13, w2, bad_ids, weights, False)[0]
        assert same_bits(got, want), (ids_given is None, weights_given is None)
        bad_rows = [2] if ids_given is None else [2, 4, 5]  # token 2's given weights are its NaN routed ones
        assert all(bool(got[t].isnan().all()) for t in bad_rows)
        assert not bool(got[[t for t in range(num_tokens) if t not in bad_rows]].isnan().any())


@case
def logprobs_kernel_gives_nan_for_out_of_range_ids():
    import torch

    from mok.kernels import logprobs as kernels

    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1)).to(dtype)
        good = torch.tensor([0, 49, 3, 7, 11, 20])
        bad = torch.tensor([0, 50, -1, 7, 2 ** 40, 20])
        full = kernels.log_softmax(logits)
        want = full.gather(1, good[:, None])[:, 0]
        assert torch.equal(kernels.logprobs(logits, good), want)
        got = kernels.logprobs(logits, bad)
        assert bool(got[[1, 2, 4]].isnan().all())
        assert torch.equal(got[[0, 3, 5]], want[[0, 3, 5]])


@case
def logprobs_cuda_backward_gives_nan_rows_for_out_of_range_ids():
    import torch

    from mok.ops import logprobs as ops

    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(2)).bfloat16()
    grad = torch.randn(5, generator=torch.Generator().manual_seed(3))
    good = torch.tensor([1, 39, 0, 5, 6])
    bad = torch.tensor([1, 40, 0, -3, 6])
    want = ops._logprobs_backward_cuda(grad, logits, good)  # the CUDA implementation's code, on CPU tensors
    got = ops._logprobs_backward_cuda(grad, logits, bad)
    assert bool(got[[1, 3]].isnan().all())
    assert torch.equal(got[[0, 2, 4]], want[[0, 2, 4]])


@case
def rotary_device_inv_freq_equals_the_host_values():
    import torch

    from mok.kernels import rotary as kernels
    from mok.reference.rotary import inv_freq

    for theta, rotary_dim in ((1e4, 64), (1e6, 128), (500000.0, 40), (10000.0, 2)):
        kernels._INV_FREQ_CACHE.pop((theta, rotary_dim, torch.device("cpu")), None)
        filled = kernels._inv_freq(theta, rotary_dim, torch.device("cpu"))
        assert filled.dtype == torch.float32 and torch.equal(filled, inv_freq(theta, rotary_dim))
        assert kernels._inv_freq(theta, rotary_dim, torch.device("cpu")) is filled  # cached


@pytest.mark.parametrize("name", sorted(CASES))
def test_cuda_paths_under_interpreter(triton_interpret, name):
    assert triton_interpret.verdicts(__file__).get(name) == "ok", triton_interpret.verdicts(__file__).get(
        name, "case did not run")


# ---------------------------------------------------------------------------------------------
# CPU: torch.compile(fullgraph=True) over the reference paths


def _recording_backend(targets: list[str]):
    """A torch.compile backend that records the graph's call targets and runs it as traced."""

    def backend(gm, example_inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    return backend


def _grads_after(outputs, grad_outputs, leaves):
    import torch

    for leaf in leaves:
        leaf.grad = None
    torch.autograd.backward(outputs, grad_outputs)
    return [leaf.grad for leaf in leaves]


def _dense_leaves():
    import torch

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, 32, generator=gen).bfloat16()
    return dict(
        x=x.requires_grad_(),
        residual=torch.randn(6, 32, generator=gen).bfloat16().requires_grad_(),
        norm_weight=(1 + 0.1 * torch.randn(32, generator=gen)).bfloat16().requires_grad_(),
        weight=(torch.randn(48, 32, generator=gen) / 32 ** 0.5).bfloat16().requires_grad_(),
        bias=torch.randn(48, generator=gen).bfloat16().requires_grad_(),
        logits=torch.randn(6, 50, generator=gen).requires_grad_(),
    )


def _dense_layer(x, residual, norm_weight, weight, bias, logits, positions, ids):
    """Every dense op once: rms_norm (plain and fused), linear, silu_and_mul, rotary, log_softmax, logprobs."""
    import mok

    y, new_residual = mok.rms_norm(x, norm_weight, 1e-6, residual)
    h = mok.linear(mok.rms_norm(y, norm_weight, 1e-5), weight, bias)  # [T, 48]
    act = mok.silu_and_mul(h)  # [T, 24]
    rotated = mok.rotary(h.reshape(h.shape[0], 3, 16), positions, 1e4)
    return new_residual, act, rotated, mok.log_softmax(logits), mok.logprobs(logits, ids)


def test_dense_ops_compile_fullgraph_equal_eager_cpu():
    import torch

    leaves = _dense_leaves()
    positions = torch.tensor([0, 1, 2, 0, 1, 9])
    ids = torch.tensor([0, 49, 3, 7, 11, 20])
    eager = _dense_layer(**leaves, positions=positions, ids=ids)
    targets: list[str] = []
    traced = torch.compile(_dense_layer, fullgraph=True, backend=_recording_backend(targets))
    assert all(same_bits(a, b) for a, b in zip(traced(**leaves, positions=positions, ids=ids), eager))
    assert all(t.startswith("mok.") for t in targets if "mok" in t) and sum("mok." in t for t in targets) == 7
    compiled = torch.compile(_dense_layer, fullgraph=True, backend="aot_eager")
    outputs = compiled(**leaves, positions=positions, ids=ids)
    assert all(same_bits(a, b) for a, b in zip(outputs, eager))
    gen = torch.Generator().manual_seed(8)
    grad_outputs = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in eager]
    grads = _grads_after(outputs, grad_outputs, list(leaves.values()))
    want = _grads_after(eager, grad_outputs, list(leaves.values()))
    assert all(g is not None and same_bits(g, w) for g, w in zip(grads, want))


def test_logprobs_out_of_range_ids_give_nan_under_compile_cpu():
    """Eager CPU raises (tests/mok/test_logprobs.py); compiled, nothing reads the ids on the host: NaN rows."""
    import torch

    import mok

    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(9)).requires_grad_()
    ids = torch.tensor([3, 30, -1, 29])
    compiled = torch.compile(lambda lg, i: mok.logprobs(lg, i), fullgraph=True, backend="aot_eager")
    out = compiled(logits, ids)
    assert bool(out[[1, 2]].isnan().all())
    want = mok.logprobs(logits[[0, 3]], ids[[0, 3]])
    assert torch.equal(out[[0, 3]], want)
    out.backward(torch.ones(4))
    assert bool(logits.grad[[1, 2]].isnan().all()) and not bool(logits.grad[[0, 3]].isnan().any())
    row_grads = torch.autograd.grad(mok.logprobs(logits[[0, 3]], ids[[0, 3]]).sum(), logits)[0]
    assert torch.equal(logits.grad[[0, 3]], row_grads[[0, 3]])


MOE_MODES = ("route", "replay ids", "replay ids and weights")


def _moe_call(mode, top_k):
    import mok

    def call(x, logits, w13, w2, ids, weights):
        kwargs = {"route": {}, "replay ids": {"topk_ids": ids},
                  "replay ids and weights": {"topk_ids": ids, "topk_weights": weights}}[mode]
        return mok.moe(x, logits, w13, w2, top_k, **kwargs)

    return call


@pytest.mark.parametrize("mode", MOE_MODES)
def test_moe_compile_fullgraph_equal_eager_cpu(mode):
    import torch

    import mok

    num_tokens, hidden, inter, num_experts, top_k = 5, 64, 32, 8, 2
    x, logits, w13, w2 = _moe_inputs(num_tokens, hidden, inter, num_experts, seed=11)
    ids, weights = mok.route(logits, top_k)
    call = _moe_call(mode, top_k)
    # no gradient: one op, mok::moe_infer, with the eager bits (which the two-op path also gives)
    targets: list[str] = []
    with torch.no_grad():
        eager = call(x, logits, w13, w2, ids, weights)
        traced = torch.compile(call, fullgraph=True, backend=_recording_backend(targets))(x, logits, w13, w2, ids,
                                                                                            weights)
    assert [t for t in targets if t.startswith("mok.")] == ["mok.moe_infer.default"]
    assert same_bits(traced, eager)
    from mok.ops.moe import _experts_op

    assert same_bits(_experts_op(x, w13, w2, ids, weights, False)[0], eager)
    # training: the autograd ops, traced forward and backward by AOTAutograd
    leaves = [t.clone().requires_grad_() for t in (x, logits, w13, w2)]
    leaf_weights = weights.clone().requires_grad_()
    out = torch.compile(call, fullgraph=True, backend="aot_eager")(*leaves, ids, leaf_weights)
    assert same_bits(out, eager)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(12)).to(out.dtype)
    grads = _grads_after([out], [grad_out], [*leaves, leaf_weights])
    want = _grads_after([call(*leaves, ids, leaf_weights)], [grad_out], [*leaves, leaf_weights])
    assert all((g is None and w is None) or same_bits(g, w) for g, w in zip(grads, want))
    assert grads[0] is not None and grads[2] is not None and grads[3] is not None


def test_wrapped_decoder_compile_fullgraph_equal_eager_cpu():
    import torch

    import rl
    from rl.models import adapter_for
    from rl.models.decoder import forward_hidden
    from rl.models.packing import pack
    from rl.testing import tiny_model

    model = rl.wrap(tiny_model("qwen3_moe", seed=0))
    adapter = adapter_for(model)
    gen = torch.Generator().manual_seed(13)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=gen)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :2] = 0
    packed = pack(input_ids, mask)  # data-dependent sizes: outside the traced region

    def decoder(ids_T, positions_T, cu_seqlens):
        return forward_hidden(adapter, ids_T, positions_T, cu_seqlens)

    args = (packed.input_ids_T, packed.positions_T, packed.cu_seqlens)
    out = torch.compile(decoder, fullgraph=True, backend="aot_eager")(*args)
    grad_out = torch.randn(out.shape, generator=gen).to(out.dtype)
    params = [p for p in model.parameters()]
    grads = _grads_after([out], [grad_out], params)
    eager = decoder(*args)
    assert same_bits(out, eager)
    want = _grads_after([eager], [grad_out], params)
    assert sum(g is not None for g in grads) > 10
    assert all((g is None and w is None) or same_bits(g, w) for g, w in zip(grads, want))


def _new_op_cases():
    import torch

    import mok
    from mok.ops import moe, routing

    x, logits, w13, w2 = _moe_inputs(4, 32, 16, 6, seed=14, dtype=torch.float32)
    ids, weights = mok.route(logits, 2)
    _, _, probs = routing._route_op(logits, 2, True)
    grad = torch.randn(4, 2, generator=torch.Generator().manual_seed(15))
    return {
        "moe_infer route": (moe._infer_op, (x, logits, w13, w2, None, None, 2, True)),
        "moe_infer replay ids": (moe._infer_op, (x, logits, w13, w2, ids.long(), None, 2, False)),
        "moe_infer replay both": (moe._infer_op, (x, logits, w13, w2, ids, weights, 2, True)),
        "route_backward": (routing._route_backward_op, (grad, probs, ids, weights, True)),
    }


@pytest.mark.parametrize("case", ["moe_infer route", "moe_infer replay ids", "moe_infer replay both",
                                  "route_backward"])
def test_new_ops_opcheck(case):
    """The ops this file brought (schema, fake impl, AOT dispatch), as tests/mok/test_opcheck.py checks the others."""
    import torch

    op, args = _new_op_cases()[case]
    result = torch.library.opcheck(
        op, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                              "test_aot_dispatch_dynamic"))
    assert all(v == "SUCCESS" for v in result.values()), result


def test_bench_moe_summary_keys_and_values():
    from bench.moe import LARGE_T, summary

    rows = [
        {"shape": "olmoe-1b-7b", "tokens": 1, "pass": "fwd", "impl": "mok", "ms": 0.09, "graph_ms": 0.03,
         "graph_ms_back_to_back": 0.02, "graph_ms_per_layer": 0.025, "weight_read_bound_ms": 0.01,
         "compiled_ms": 0.05},
        {"shape": "olmoe-1b-7b", "tokens": 1, "pass": "fwd", "impl": "grouped_mm", "ms": 0.5},
        {"shape": "olmoe-1b-7b", "tokens": LARGE_T, "pass": "fwd", "impl": "mok", "tflops": 400.0},
        {"shape": "olmoe-1b-7b", "tokens": LARGE_T, "pass": "fwd+bwd", "impl": "mok", "tflops": 300.0,
         "speedup_vs_grouped_mm": 1.2},
    ]
    got = summary(rows, ["olmoe-1b-7b", "deepseek-v3"])
    assert got["olmoe-1b-7b"] == {"decode_t1_graph_ms": 0.03, "decode_t1_graph_back_to_back_ms": 0.02,
                                  "decode_t1_graph_ms_per_layer": 0.025, "decode_t1_eager_ms": 0.09,
                                  "decode_t1_compiled_ms": 0.05, "hbm_bound_t1_ms": 0.01, "fwd_tflops": 400.0,
                                  "fwdbwd_tflops": 300.0, "fwdbwd_ratio_vs_grouped_mm": 1.2}
    assert set(got) == {"olmoe-1b-7b", "deepseek-v3"} and set(got["deepseek-v3"].values()) == {None}


# ---------------------------------------------------------------------------------------------
# GPU: CUDA-graph capture and replay, torch.compile (inductor), no host synchronisation

gpu = pytest.mark.gpu

# (T, H, I, E, K): qwen3-30b-a3b's MoE layer at decode (T=1), a small batch and past the schedule kernel
# (2400 slots, the kernels' limit held at 2048 by _schedule_path: the torch schedule); few large experts (the
# "large" configs: TMA descriptors)
GPU_MOE = {"decode": (1, 2048, 768, 128, 8), "small": (64, 2048, 768, 128, 8),
           "torch-schedule": (300, 2048, 768, 128, 8), "tma": (2048, 1024, 512, 8, 2)}


def _schedule_path(shape: str, monkeypatch) -> None:
    """The "torch-schedule" shape runs with the schedule kernels' limit below its slots (the path training
    batches above configs.SCHEDULE_KERNEL_MAX_SLOTS take)."""
    from mok.kernels.moe import configs

    if shape == "torch-schedule":
        monkeypatch.setattr(configs, "SCHEDULE_KERNEL_MAX_SLOTS", 2048)


@contextlib.contextmanager
def _no_sync():
    """torch raises on any host synchronisation (item, nonzero, blocking copies, stream syncs) inside."""
    import torch

    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _warm_up(fn, times=2):
    """Run fn on a side stream first (the CUDA-graph recipe: compilation and caches outside the capture)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(times):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()


def _capture(fn):
    """-> (graph, the static result of fn() recorded into it)."""
    import torch

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


def _copy_into(static, values):
    import torch

    with torch.no_grad():
        for s, v in zip(static, values):
            s.copy_(v)


@gpu
@pytest.mark.parametrize("shape", sorted(GPU_MOE))
@pytest.mark.parametrize("mode", MOE_MODES)
def test_moe_forward_cuda_graph_replay_equals_eager(mode, shape, monkeypatch):
    import torch

    import mok

    _schedule_path(shape, monkeypatch)
    num_tokens, hidden, inter, num_experts, top_k = GPU_MOE[shape]
    call = _moe_call(mode, top_k)
    x, logits, w13, w2 = _moe_inputs(num_tokens, hidden, inter, num_experts, seed=20, device="cuda")
    static = [x.clone(), logits.clone(), *mok.route(logits, top_k)]
    with torch.no_grad():
        _warm_up(lambda: call(static[0], static[1], w13, w2, static[2], static[3]))
        graph, static_out = _capture(lambda: call(static[0], static[1], w13, w2, static[2], static[3]))
        for seed in (21, 22):  # new inputs each replay: the graph reads its buffers, nothing was frozen
            new_x, new_logits, _, _ = _moe_inputs(num_tokens, hidden, inter, num_experts, seed=seed, device="cuda")
            new_ids, new_weights = mok.route(new_logits, top_k)
            _copy_into(static, (new_x, new_logits, new_ids, new_weights))
            graph.replay()
            torch.cuda.synchronize()
            eager = call(new_x, new_logits, w13, w2, new_ids, new_weights)
            assert same_bits(static_out, eager), (mode, shape, seed)
            assert not bool(eager.isnan().any())
            with _no_sync():
                again = call(new_x, new_logits, w13, w2, new_ids, new_weights)
            assert same_bits(again, eager)
        # the inference op (mok::moe_infer) gives the bits of the training path (route/replay + moe_experts)
        with torch.enable_grad():
            trained = call(new_x.clone().requires_grad_(), new_logits.clone().requires_grad_(), w13, w2, new_ids,
                           new_weights.clone().requires_grad_())
        assert trained.requires_grad and same_bits(trained.detach(), eager)


@gpu
@pytest.mark.parametrize("shape", sorted(GPU_MOE))
@pytest.mark.parametrize("mode", ["route", "replay ids and weights"])
def test_moe_forward_backward_cuda_graph_replay_equals_eager(mode, shape, monkeypatch):
    import torch

    import mok

    _schedule_path(shape, monkeypatch)
    num_tokens, hidden, inter, num_experts, top_k = GPU_MOE[shape]
    call = _moe_call(mode, top_k)
    x, logits, w13, w2 = _moe_inputs(num_tokens, hidden, inter, num_experts, seed=30, device="cuda")
    ids, weights = mok.route(logits, top_k)
    leaves = [t.clone().requires_grad_() for t in (x, logits, w13, w2, weights)]
    static_ids = ids.clone()
    static_grad = torch.randn(num_tokens, hidden, device="cuda").bfloat16()

    def step():
        out = call(*leaves[:4], static_ids, leaves[4])
        out.backward(static_grad)
        return out

    def clear():
        for leaf in leaves:
            leaf.grad = None

    def run():
        clear()
        return step()

    _warm_up(run)
    clear()
    graph, static_out = _capture(step)
    static_grads = [leaf.grad for leaf in leaves]
    used = [0, 2, 3] + ([1] if mode == "route" else [4])  # logits or the given weights get the routing gradient
    assert all(static_grads[i] is not None for i in used)
    for seed in (31, 32):
        new_x, new_logits, _, _ = _moe_inputs(num_tokens, hidden, inter, num_experts, seed=seed, device="cuda")
        new_ids, new_weights = mok.route(new_logits, top_k)
        new_grad = torch.randn(num_tokens, hidden, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        _copy_into([*leaves[:2], leaves[4], static_ids, static_grad],
                   (new_x, new_logits, new_weights, new_ids, new_grad.bfloat16()))
        graph.replay()
        torch.cuda.synchronize()
        got = [static_out.detach().clone()] + [static_grads[i].clone() for i in used]
        eager_leaves = [t.detach().clone().requires_grad_() for t in leaves]
        with _no_sync():
            eager = call(*eager_leaves[:4], static_ids, eager_leaves[4])
            eager.backward(static_grad)
        want = [eager.detach()] + [eager_leaves[i].grad for i in used]
        assert all(same_bits(g, w) for g, w in zip(got, want)), (mode, shape, seed)


@gpu
def test_moe_layer_compile_fullgraph_inductor_equals_eager():
    import torch

    import mok

    torch.manual_seed(0)
    layer = mok.MoE(2048, 768, 128, 8, device="cuda")
    x = torch.randn(37, 2048, device="cuda").bfloat16()
    compiled = torch.compile(layer, fullgraph=True)
    with torch.no_grad():
        assert same_bits(compiled(x), layer(x))
    grad = torch.randn(37, 2048, device="cuda").bfloat16()
    leaf = x.clone().requires_grad_()
    out = compiled(leaf)
    out.backward(grad)
    got = [out.detach(), leaf.grad] + [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad(set_to_none=True)
    leaf_eager = x.clone().requires_grad_()
    eager = layer(leaf_eager)
    eager.backward(grad)
    want = [eager.detach(), leaf_eager.grad] + [p.grad for p in layer.parameters()]
    assert all(same_bits(g, w) for g, w in zip(got, want))


@gpu
def test_moe_decode_compiled_reduce_overhead_equals_eager():
    """A decode-sized MoE layer inside torch.compile(mode="reduce-overhead") (replayed from torch's CUDA graphs, new
    inputs copied in at every call): the eager bits, call after call (bench/moe.py times it)."""
    import torch

    import mok

    torch.manual_seed(0)
    layer = mok.MoE(2048, 768, 128, 8, device="cuda")
    compiled = torch.compile(layer, fullgraph=True, mode="reduce-overhead")
    gen = torch.Generator(device="cuda").manual_seed(1)
    try:
        with torch.no_grad():
            for num_tokens in (1, 1, 1, 5, 5, 5):
                x = torch.randn(num_tokens, 2048, device="cuda", generator=gen).bfloat16()
                assert same_bits(compiled(x).clone(), layer(x)), num_tokens
    finally:
        torch.compiler.reset()


def _gpu_dense_inputs(seed):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    return dict(
        x=randn(6, 32).bfloat16(), residual=randn(6, 32).bfloat16(), norm_weight=(1 + 0.1 * randn(32)).bfloat16(),
        weight=(randn(48, 32) / 32 ** 0.5).bfloat16(), bias=randn(48).bfloat16(), logits=randn(6, 50),
        positions=torch.randint(0, 4096, (6,), generator=gen, device="cuda"),
        ids=torch.randint(0, 50, (6,), generator=gen, device="cuda"),
    )


@gpu
def test_dense_ops_cuda_graph_replay_and_no_sync_equal_eager():
    """Every dense op forward and backward captured and replayed with new inputs; eager with the sync detector."""
    import torch

    from mok.kernels import rotary

    static = _gpu_dense_inputs(40)
    differentiable = ("x", "residual", "norm_weight", "weight", "bias", "logits")
    for key in differentiable:
        static[key].requires_grad_()
    grads_out = [torch.randn(shape, device="cuda").to(dtype)
                 for shape, dtype in (((6, 32), torch.bfloat16), ((6, 24), torch.bfloat16),
                                      ((6, 3, 16), torch.bfloat16), ((6, 50), torch.float32), ((6,), torch.float32))]

    def clear():
        for key in differentiable:
            static[key].grad = None

    def step():
        outputs = _dense_layer(**static)
        torch.autograd.backward(outputs, grads_out)
        return outputs

    _warm_up(lambda: (clear(), step()))
    clear()
    graph, static_outputs = _capture(step)
    static_grads = [static[key].grad for key in differentiable]
    new = _gpu_dense_inputs(41)
    _copy_into([static[key] for key in new], new.values())
    graph.replay()
    torch.cuda.synchronize()
    got = [o.detach().clone() for o in static_outputs] + [g.clone() for g in static_grads]
    leaves = {key: (value.clone().requires_grad_() if key in differentiable else value) for key, value in new.items()}
    rotary._INV_FREQ_CACHE.clear()  # the first call's inv_freq fill and cos/sin table build must not synchronise
    rotary.clear_tables()  # (the graph above keeps reading its table: clear_tables keeps it allocated)
    with _no_sync():
        outputs = _dense_layer(**leaves)
        torch.autograd.backward(outputs, grads_out)
    want = [o.detach() for o in outputs] + [leaves[key].grad for key in differentiable]
    assert all(same_bits(g, w) for g, w in zip(got, want))


@gpu
def test_logprobs_out_of_range_ids_cuda_nan_without_sync():
    import torch

    import mok

    logits = torch.randn(5, 151936, device="cuda").bfloat16().requires_grad_()
    ids = torch.tensor([3, 151936, -1, 2 ** 40, 7], device="cuda")
    good = [0, 4]
    mok.logprobs(logits, ids)  # warm
    with _no_sync():
        out = mok.logprobs(logits, ids)
        out.backward(torch.ones(5, device="cuda"))
    assert bool(out[[1, 2, 3]].isnan().all())
    want = mok.logprobs(logits[good], ids[good])
    assert torch.equal(out[good], want)
    assert bool(logits.grad[[1, 2, 3]].float().isnan().all())
    assert not bool(logits.grad[good].float().isnan().any())


def _gpu_decoder():
    """A Qwen3-MoE model of two decoder layers shaped like Qwen3-30B-A3B's layer, wrapped; its adapter."""
    import rl
    from rl.models import adapter_for
    from rl.testing import tiny_model

    model = rl.wrap(tiny_model(
        "qwen3_moe", seed=0, device="cuda", hidden_size=2048, num_hidden_layers=2, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        intermediate_size=6144, vocab_size=4096, norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}))
    return model, adapter_for(model)


def _decoder_layer(adapter, index, x_TH, residual_TH, positions_T, cu_seqlens):
    """One decoder layer exactly as rl.models.decoder.forward_hidden runs it (after the first)."""
    import mok
    from rl.models import decoder

    layer = adapter.layers[index]
    x_TH, residual_TH = mok.rms_norm(x_TH, layer.input_norm.weight, layer.input_norm.eps, residual_TH)
    x_TH = decoder._attention(layer.attention, adapter, x_TH, positions_T, cu_seqlens, decoder.no_cache(cu_seqlens),
                              index)
    x_TH, residual_TH = mok.rms_norm(x_TH, layer.post_attention_norm.weight, layer.post_attention_norm.eps,
                                     residual_TH)
    return decoder._sparse_moe(layer.mlp, x_TH, index), residual_TH


def _packed_batch(seed, lengths=(9, 1, 17)):
    import torch

    from rl.models.packing import pack

    gen = torch.Generator().manual_seed(seed)
    longest = max(lengths)
    input_ids = torch.randint(0, 4096, (len(lengths), longest), generator=gen)
    mask = torch.zeros(len(lengths), longest, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, longest - length:] = 1  # left padding
    return pack(input_ids.cuda(), mask.cuda())  # outside the captured region: sizes follow the mask


@gpu
def test_wrapped_decoder_cuda_graph_and_compile_equal_eager():
    """The whole decoder forward (embedding, layers, final norm) captured and compiled; one layer's forward
    and backward captured; eager forward and backward with the sync detector armed."""
    import torch

    from rl.models.decoder import forward_hidden

    model, adapter = _gpu_decoder()
    packed = _packed_batch(50)
    static = [packed.input_ids_T.clone(), packed.positions_T.clone(), packed.cu_seqlens.clone()]

    def decoder(ids_T, positions_T, cu_seqlens):
        return forward_hidden(adapter, ids_T, positions_T, cu_seqlens)

    with torch.no_grad():
        _warm_up(lambda: decoder(*static))
        graph, static_hidden = _capture(lambda: decoder(*static))
        new = _packed_batch(51)  # same lengths, new tokens
        _copy_into(static, (new.input_ids_T, new.positions_T, new.cu_seqlens))
        graph.replay()
        torch.cuda.synchronize()
        with _no_sync():
            eager = decoder(new.input_ids_T, new.positions_T, new.cu_seqlens)
        assert same_bits(static_hidden, eager)
        compiled = torch.compile(decoder, fullgraph=True)
        assert same_bits(compiled(new.input_ids_T, new.positions_T, new.cu_seqlens), eager)

    # one layer, forward and backward (hidden states in, parameter gradients out)
    num_tokens = packed.input_ids_T.numel()
    gen = torch.Generator(device="cuda").manual_seed(52)
    x = torch.randn(num_tokens, 2048, generator=gen, device="cuda").bfloat16().requires_grad_()
    residual = torch.randn(num_tokens, 2048, generator=gen, device="cuda").bfloat16().requires_grad_()
    grad_x, grad_residual = (torch.randn(num_tokens, 2048, generator=gen, device="cuda").bfloat16() for _ in range(2))
    params = [p for p in model.model.layers[1].parameters()]

    def step():
        outputs = _decoder_layer(adapter, 1, x, residual, static[1], static[2])
        torch.autograd.backward(outputs, (grad_x, grad_residual))
        return outputs

    def clear():
        for t in [x, residual, *params]:
            t.grad = None

    _warm_up(lambda: (clear(), step()))
    clear()
    graph, static_outputs = _capture(step)
    static_grads = [t.grad for t in [x, residual, *params]]
    assert sum(g is not None for g in static_grads) >= 10
    _copy_into([x, residual, grad_x], [torch.randn_like(x), torch.randn_like(residual), torch.randn_like(grad_x)])
    graph.replay()
    torch.cuda.synchronize()
    got = [o.detach().clone() for o in static_outputs] + [g.clone() for g in static_grads if g is not None]
    clear()
    with _no_sync():
        outputs = _decoder_layer(adapter, 1, x, residual, static[1], static[2])
        torch.autograd.backward(outputs, (grad_x, grad_residual))
    want_all = [o.detach() for o in outputs] + [t.grad for t in [x, residual, *params]]
    want = [t for t in want_all if t is not None]
    assert len(got) == len(want) and all(same_bits(g, w) for g, w in zip(got, want))

    # The same layer under torch.compile(fullgraph=True), forward and backward. Outside mok's ops autograd
    # sums the gradients of a tensor used several times (x feeds q, k and v): eager rounds each bf16 add,
    # inductor would fuse the adds in fp32 unless it emulates eager's rounding (emulate_precision_casts).
    import torch._inductor.config as inductor_config

    with inductor_config.patch(emulate_precision_casts=True):
        compiled_layer = torch.compile(_decoder_layer, fullgraph=True)
        clear()
        outputs = compiled_layer(adapter, 1, x, residual, static[1], static[2])
        torch.autograd.backward(outputs, (grad_x, grad_residual))
    names = ["out x", "out residual", "d x", "d residual"] + [n for n, _ in model.model.layers[1].named_parameters()]
    compiled_got = [o.detach() for o in outputs] + [t.grad for t in [x, residual, *params]]
    assert len(compiled_got) == len(names)
    mismatched = [n for n, g, w in zip(names, compiled_got, want_all)
                  if (g is None) != (w is None) or (g is not None and not same_bits(g, w))]
    # every output and gradient, the layer's inputs' included (H200 2026-12-01: their summed bf16 gradients
    # differed under inductor until the rms_norm backward added the residual gradient inside its kernel)
    assert not mismatched, mismatched


if __name__ == "__main__":
    sys.exit(run_cases(CASES))
