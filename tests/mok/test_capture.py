"""Capture without host synchronisation: every mok op, and a wrapped decoder layer, traced by
torch.compile(fullgraph=True), captured in CUDA graphs, and run with torch's sync detector armed.

CPU (CI): torch.compile(fullgraph=True, backend="aot_eager") over the CPU reference paths (the custom ops'
fake impls and autograd registrations trace with no graph break) gives the eager bits, forward and
backward; the no-grad MoE forward is the one-dispatch `mok::moe_infer`; out-of-range logprobs ids give
NaN under compile. Interpreter cases (TRITON_INTERPRET=1, one child process, like test_moe_interpret.py)
run the CUDA code paths on CPU tensors: `moe_infer` gives the bits of route + moe_forward with two
allocations, the logprobs kernel and CUDA backward give NaN for out-of-range ids, the device inv_freq
of rotary equals the host's.
GPU (marker gpu): test_capture_gpu.py. Shared inputs and calls: tests/helpers/capture.py.
"""
from __future__ import annotations

import contextlib
import sys

import pytest

from tests.helpers.bits import same_bits
from tests.helpers.capture import MOE_MODES, dense_layer, moe_call, moe_inputs
from tests.helpers.interpret import Cases, interpreter_test, run_cases

CASES = Cases()
case = CASES.case


# (T, H, I, E, K) of the interpreter cases: one decode token, odd sizes, more experts than tokens
INTERPRET_SHAPES = [(1, 64, 32, 16, 4), (7, 40, 24, 6, 3), (3, 64, 32, 16, 4)]


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
        x, logits, w13, w2 = moe_inputs(num_tokens, hidden, inter, num_experts, seed=num_tokens)
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
    x, logits, w13, w2 = moe_inputs(num_tokens, hidden, inter, num_experts, seed=3)
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
    x, logits, w13, w2 = moe_inputs(num_tokens, hidden, inter, num_experts, seed=5)
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


test_cuda_paths_under_interpreter = interpreter_test(CASES, __file__)


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


def test_dense_ops_compile_fullgraph_equal_eager_cpu():
    import torch

    leaves = _dense_leaves()
    positions = torch.tensor([0, 1, 2, 0, 1, 9])
    ids = torch.tensor([0, 49, 3, 7, 11, 20])
    eager = dense_layer(**leaves, positions=positions, ids=ids)
    targets: list[str] = []
    traced = torch.compile(dense_layer, fullgraph=True, backend=_recording_backend(targets))
    assert all(same_bits(a, b) for a, b in zip(traced(**leaves, positions=positions, ids=ids), eager))
    assert all(t.startswith("mok.") for t in targets if "mok" in t) and sum("mok." in t for t in targets) == 7
    compiled = torch.compile(dense_layer, fullgraph=True, backend="aot_eager")
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


@pytest.mark.parametrize("mode", MOE_MODES)
def test_moe_compile_fullgraph_equal_eager_cpu(mode):
    import torch

    import mok

    num_tokens, hidden, inter, num_experts, top_k = 5, 64, 32, 8, 2
    x, logits, w13, w2 = moe_inputs(num_tokens, hidden, inter, num_experts, seed=11)
    ids, weights = mok.route(logits, top_k)
    call = moe_call(mode, top_k)
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

    x, logits, w13, w2 = moe_inputs(4, 32, 16, 6, seed=14, dtype=torch.float32)
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


if __name__ == "__main__":
    sys.exit(run_cases(CASES))
