"""The dense ops' Triton paths on a CUDA GPU: batch invariance over batch sizes 1..4096, prefill ==
chunked prefill == decode for attention, rerun determinism (forward and backward), accuracy."""

import re

import pytest
import torch

import mok
from mok.ops.attention import attention
from mok.ops.logprobs import log_softmax, logprobs

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
BATCH_SIZES = [1, 2, 3, 7, 16, 64, 100, 511, 1000, 4096]


def _randn(*shape, dtype=torch.bfloat16, seed=0, scale=1.0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=DEVICE) * scale).to(dtype)


def _assert_rows_invariant(fn, *row_inputs):
    """fn on the first bs rows (and on rows [bs, 2bs)) equals the same rows of fn on all 4096 rows."""
    full = fn(*row_inputs)
    for bs in BATCH_SIZES:
        assert torch.equal(fn(*(t[:bs] for t in row_inputs)), full[:bs]), f"batch size {bs}"
        if 2 * bs <= row_inputs[0].shape[0]:
            assert torch.equal(fn(*(t[bs : 2 * bs] for t in row_inputs)), full[bs : 2 * bs]), f"offset batch {bs}"
    assert torch.equal(fn(*row_inputs), full), "rerun"
    return full


@pytest.mark.parametrize("k,n", [(2048, 768), (2048, 4096), (768, 2048), (2048, 32000)])
def test_linear_batch_invariant_and_accurate(k, n):
    x, w = _randn(4096, k), _randn(n, k, seed=1, scale=k**-0.5)
    full = _assert_rows_invariant(lambda x_: mok.linear(x_, w), x)
    torch.testing.assert_close(full.float(), (x.float() @ w.float().t()).bfloat16().float(), atol=2e-2, rtol=2e-2)


def test_linear_with_bias_fp32_and_fp16():
    for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 2e-3)):
        x, w, b = (
            _randn(4096, 256, dtype=dtype),
            _randn(96, 256, dtype=dtype, seed=1, scale=1 / 16),
            _randn(96, dtype=dtype, seed=2),
        )
        full = _assert_rows_invariant(lambda x_: mok.linear(x_, w, b), x)
        torch.testing.assert_close(
            full.double(), (x.double() @ w.double().t() + b.double()).to(dtype).double(), atol=tol, rtol=tol
        )


def test_rms_norm_batch_invariant_and_accurate():
    x, r, w = _randn(4096, 2048, scale=3), _randn(4096, 2048, seed=1), _randn(2048, seed=2)
    y = _assert_rows_invariant(lambda x_: mok.rms_norm(x_, w, 1e-6), x)
    xd = x.double()
    torch.testing.assert_close(
        y.float(),
        (xd / torch.sqrt(xd.square().mean(-1, keepdim=True) + 1e-6) * w.double()).float(),
        atol=3e-2,
        rtol=1.6e-2,
    )
    _assert_rows_invariant(lambda x_, r_: torch.cat(mok.rms_norm(x_, w, 1e-6, r_), -1), x, r)
    q = _randn(4096, 32, 128)
    _assert_rows_invariant(lambda q_: mok.rms_norm(q_, w[:128], 1e-6), q)


@pytest.fixture(params=["python", "native"])
def rms_norm_plans(request, monkeypatch):
    """The planned path mok.rms_norm's eager calls take: the launchers' Python plans (mok/kernels/rms_norm.py
    `plans`, the native path off) or the native eager path (mok/kernels/native, built here: the GPU machine has a
    compiler and CUDA headers). `.counts()`: (keys, keys without a plan, calls that found their key) since the
    fixture began; `.unplanned()` turns both off, for the reference calls."""
    from types import SimpleNamespace

    from mok.kernels import launch, native
    from mok.kernels import rms_norm as kernels

    if request.param == "python":
        monkeypatch.setattr(native, "ENABLED", False)
        replays, real_launch = [], launch.LaunchPlan.launch
        monkeypatch.setattr(launch.LaunchPlan, "launch", lambda plan, per_call: (replays.append(plan),
                                                                                   real_launch(plan, per_call)))
        kernels.plans.clear()

        def counts():
            held = kernels.plans.plans.values()
            return len(held), sum(plan is None for plan in held), len(replays)
    else:
        assert native.load() is not None
        native.clear()
        found_before = native.stats()[3]

        def counts():
            keys, unplanned, _, found = native.stats()
            return keys, unplanned, found - found_before

    def unplanned():
        monkeypatch.setattr(native, "ENABLED", False)
        monkeypatch.setattr(kernels.plans, "capacity", 0)

    return SimpleNamespace(counts=counts, unplanned=unplanned, path=request.param)


@pytest.mark.parametrize("num_tokens", [1, 5, 4096])
def test_rms_norm_plans_replay_the_bits_of_unplanned_calls(num_tokens, rms_norm_plans):
    """mok.rms_norm's eager calls replay launch plans (Python's or the native path's): forward without a residual,
    with a bf16 one and an fp32 one (d x then in two dtypes), and their backwards, x aligned and misaligned (keys of
    their own), two layers' weights (one plan): twice over, every output and gradient has the bits of the same call
    unplanned, and every call but each key's first is a replay."""
    hidden = 2048
    base = _randn(num_tokens * hidden + 1, scale=3)
    residual = _randn(num_tokens, hidden, seed=4)
    grads = (_randn(num_tokens, hidden, seed=5), _randn(num_tokens, hidden, seed=6))
    cases = [(x, _randn(hidden, seed=seed), r) for x in (base[:-1].view(num_tokens, hidden),
                                                         base[1:].view(num_tokens, hidden))
             for seed in (2, 3) for r in (None, residual, residual.float() * 0.5)]

    def forward_backward(x, weight, residual):
        leaves = [t.detach().requires_grad_() for t in (x, weight, *(() if residual is None else (residual,)))]
        out = mok.rms_norm(*leaves[:2], 1e-6, *leaves[2:])
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, grads[:len(outs)])
        return [o.detach() for o in outs] + [leaf.grad for leaf in leaves]

    planned = [[forward_backward(*case) for case in cases] for _ in range(2)]
    keys, unplanned_keys, replays = rms_norm_plans.counts()
    assert unplanned_keys == 0
    assert replays == 2 * 2 * len(cases) - keys  # a forward and a backward per call
    rms_norm_plans.unplanned()
    unplanned = [forward_backward(*case) for case in cases]
    assert rms_norm_plans.counts()[2] == replays
    for calls in planned:
        for got, want in zip(calls, unplanned):
            assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_rms_norm_plans_with_row_strided_and_aliased_inputs(rms_norm_plans):
    """Inputs a replay must not confuse: x's rows strided inside a wider buffer (a view of a fused projection), the
    residual being x itself, x and the residual as two column blocks of one buffer (no plan for their keys), then the
    same shapes without aliasing, 3-D x, and a fused call whose new residual is unused (its gradient comes as zeros):
    twice over, planned calls give the bits of the same calls unplanned, and the strided keys replay."""
    rows, hidden = 64, 2048
    buffer = _randn(rows, 2 * hidden, scale=3)
    other = _randn(rows, hidden, seed=7)
    weight = _randn(hidden, seed=2)
    grads = (_randn(rows, hidden, seed=5), _randn(rows, hidden, seed=6))
    strided = buffer[:, :hidden]
    cases = [(strided, None, 2), (strided, other, 2), (other, "x", 2), (strided, buffer[:, hidden:], 2),
             (other.clone(), buffer[:, hidden:].contiguous(), 2), (other.view(4, 16, hidden), None, 1),
             (strided, other, 1)]

    def forward_backward(x, residual, used_outputs):
        x_leaf, weight_leaf = x.detach().requires_grad_(), weight.detach().requires_grad_()
        leaves = [x_leaf, weight_leaf]
        if residual is None:
            outs = (mok.rms_norm(x_leaf, weight_leaf, 1e-6),)
        else:
            residual_leaf = x_leaf if isinstance(residual, str) else residual.detach().requires_grad_()
            leaves += [] if isinstance(residual, str) else [residual_leaf]
            outs = mok.rms_norm(x_leaf, weight_leaf, 1e-6, residual_leaf)
        outs = outs[:used_outputs]
        torch.autograd.backward(outs, [g.view(o.shape) for g, o in zip(grads, outs)])
        return [o.detach() for o in outs] + [leaf.grad for leaf in leaves]

    planned = [[forward_backward(*case) for case in cases] for _ in range(2)]
    _, unplanned_keys, replays = rms_norm_plans.counts()
    assert replays and unplanned_keys
    rms_norm_plans.unplanned()
    unplanned = [forward_backward(*case) for case in cases]
    assert strided.stride(0) == 2 * hidden
    for calls in planned:
        for got, want in zip(calls, unplanned):
            assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def _assert_captured_calls_give(calls, want):
    """calls() captured in a CUDA graph on the native path, its last call's key first seen in the capture (the only
    key recorded there): the graph's replay, into outputs zeroed after the capture, gives `want`."""
    from mok.kernels import native

    records_before = native.stats()[2]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = calls()
    assert native.stats()[2] == records_before + 1
    for out in captured:
        out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, want))


def test_native_rms_norm_replays_inside_a_cuda_graph_and_without_grad():
    """The native path under CUDA-graph capture (a key recorded eagerly and replayed in the capture, and a key whose
    first call is inside it) and under no_grad and inference_mode: the eager Python path's bits; no autograd node
    without grad."""
    from mok.kernels import native

    assert native.load() is not None
    native.clear()
    x, r, w = _randn(512, 2048, scale=3), _randn(512, 2048, seed=1), _randn(2048, seed=2)
    x_new_key = _randn(48, 2048, seed=3)

    def calls():
        return [mok.rms_norm(x, w, 1e-6), *mok.rms_norm(x, w, 1e-6, r), mok.rms_norm(x_new_key, w, 1e-6)]

    native.ENABLED = False
    try:
        want = calls()
    finally:
        native.ENABLED = True
    mok.rms_norm(x, w, 1e-6)
    mok.rms_norm(x, w, 1e-6, r)
    _assert_captured_calls_give(calls, want)
    leaf = x.detach().requires_grad_()
    with torch.no_grad():
        no_grad = mok.rms_norm(leaf, w, 1e-6)
    with torch.inference_mode():
        inference = mok.rms_norm(x, w, 1e-6, r)
    assert no_grad.grad_fn is None and torch.equal(no_grad, want[0])
    assert torch.equal(inference[0], want[1]) and torch.equal(inference[1], want[2])


@pytest.mark.parametrize("path", ["python", "native"])
def test_rms_norm_refuses_double_backward(path, monkeypatch):
    """A first-order gradient taken with create_graph=True has the plain gradient's bits, and differentiating it again
    raises: mok::rms_norm_backward has no autograd formula. Both paths behave alike (the native one attaches its
    gradients to a node that raises), rather than give a gradient whose second-order terms are silently missing."""
    from mok.kernels import native

    monkeypatch.setattr(native, "ENABLED", path == "native")
    x, w = _randn(64, 256, scale=3).requires_grad_(), _randn(256, seed=2).requires_grad_()
    plain = torch.autograd.grad(mok.rms_norm(x, w, 1e-6).float().square().sum(), (x, w))
    for residual in (None, _randn(64, 256, seed=3).requires_grad_()):
        out = mok.rms_norm(x, w, 1e-6, residual)
        first, = torch.autograd.grad(sum(o.float().sum() for o in (out if residual is not None else (out,))), x,
                                     create_graph=True)
        assert first.requires_grad
        with pytest.raises(RuntimeError):
            first.sum().backward()
    first = torch.autograd.grad(mok.rms_norm(x, w, 1e-6).float().square().sum(), (x, w), create_graph=True)
    assert all(torch.equal(a.detach(), b) for a, b in zip(first, plain))
    monkeypatch.setattr(native, "ENABLED", path != "native")
    assert all(torch.equal(a, b) for a, b in zip(plain, torch.autograd.grad(
        mok.rms_norm(x, w, 1e-6).float().square().sum(), (x, w))))


def test_native_rms_norm_follows_a_settings_change_after_clear():
    """The backward's module settings (BACKWARD_MAX_PROGRAMS, COLUMN_SUM) changed and native.clear() called: the native
    path's gradients have the bits of the Python path under the new settings (which differ from the old ones: an
    fp32 weight, whose gradient keeps the summation order's last bits; a bf16 one rounded them away on the H200)."""
    from mok.kernels import native
    from mok.kernels import rms_norm as kernels

    assert native.load() is not None
    x, w, g = _randn(4096, 2048, scale=3), _randn(2048, seed=2, dtype=torch.float32), _randn(4096, 2048, seed=5)

    def gradients(enabled):
        native.ENABLED = enabled
        leaves = [x.detach().requires_grad_(), w.detach().requires_grad_()]
        mok.rms_norm(*leaves, 1e-6).backward(g)
        return [leaf.grad for leaf in leaves]

    saved = kernels.BACKWARD_MAX_PROGRAMS, kernels.COLUMN_SUM
    try:
        before = gradients(True)
        kernels.BACKWARD_MAX_PROGRAMS, kernels.COLUMN_SUM = 32, dict(saved[1], BLOCK_P=8)
        native.clear()
        after_native, after_python = gradients(True), gradients(False)
    finally:
        kernels.BACKWARD_MAX_PROGRAMS, kernels.COLUMN_SUM = saved
        native.ENABLED = True
        native.clear()
    assert not torch.equal(before[1], after_python[1])
    assert all(torch.equal(a, b) for a, b in zip(after_native, after_python))


def test_native_rms_norm_aliased_calls_keep_their_own_key():
    """A call whose residual is x (aliased: no plan) does not leave the calls of the same sizes that do not alias
    unplanned: those get their own key, recorded once and then replayed; both give the Python path's bits."""
    from mok.kernels import native

    assert native.load() is not None
    native.clear()
    x, r, w = _randn(256, 2048, scale=3), _randn(256, 2048, seed=1), _randn(2048, seed=2)
    _, _, records_before, found_before = native.stats()  # (counts since loading)
    with torch.no_grad():
        aliased = mok.rms_norm(x, w, 1e-6, x)
        assert native.stats()[:3] == (1, 1, records_before + 1)
        separate = [mok.rms_norm(x, w, 1e-6, r) for _ in range(3)]
        keys, unplanned, records, found = native.stats()
        assert (keys, unplanned, records - records_before, found - found_before) == (2, 1, 2, 2)
        native.ENABLED = False
        try:
            want = mok.rms_norm(x, w, 1e-6, x), mok.rms_norm(x, w, 1e-6, r)
        finally:
            native.ENABLED = True
    assert all(torch.equal(a, b) for a, b in zip(aliased, want[0]))
    assert all(torch.equal(a, b) for call in separate for a, b in zip(call, want[1]))


LINEAR_CASES = [  # (T, F, O, x's dtype, w's dtype, bias dtype or None): every matmul config, TMA and pointer loads
    (4096, 2048, 5120, torch.bfloat16, torch.bfloat16, None),  # large tiles, TMA
    (1500, 2048, 123, torch.bfloat16, torch.bfloat16, torch.bfloat16),  # d w: O rows of the large tiles, odd columns
    (300, 768, 64, torch.float16, torch.float16, torch.float32),  # small and narrow tiles
    (1, 2048, 5120, torch.bfloat16, torch.bfloat16, torch.bfloat16),  # decode tiles
    (5, 123, 123, torch.bfloat16, torch.bfloat16, None),  # unaligned strides: pointer loads
    (77, 256, 384, torch.float32, torch.float32, torch.float32),  # fp32
    (64, 256, 384, torch.bfloat16, torch.float32, None),  # mixed dtypes (upcast)
]


@pytest.mark.parametrize("t,f,o,x_dtype,w_dtype,bias_dtype", LINEAR_CASES)
def test_native_linear_replays_the_bits_of_the_python_path(t, f, o, x_dtype, w_dtype, bias_dtype):
    """mok.linear's plain eager calls on the native path (mok/kernels/native: C++ forward, backward and autograd node
    replaying the launches, TMA descriptors encoded at each replay): out, d x, d w and d bias have the bits of the
    Python path, for x contiguous and x's rows strided inside a wider buffer (a key of its own), twice over; every key
    gets a plan and every call but a key's first replays it."""
    from mok.kernels import native

    assert native.load() is not None
    native.clear()
    buffer = _randn(t, 2 * f, dtype=x_dtype, scale=2)
    w, grad = _randn(o, f, dtype=w_dtype, seed=1, scale=0.05), _randn(t, o, dtype=x_dtype, seed=3)
    bias = None if bias_dtype is None else _randn(o, dtype=bias_dtype, seed=2)
    inputs = [_randn(t, f, dtype=x_dtype, seed=4, scale=2), buffer[:, f:]]  # (strides (F, 1) and (2F, 1): two keys)

    def forward_backward(x):
        leaves = [x.detach().requires_grad_(), w.detach().requires_grad_()]
        leaves += [] if bias is None else [bias.detach().requires_grad_()]
        out = mok.linear(*leaves)
        out.backward(grad)
        return [out.detach()] + [leaf.grad for leaf in leaves]

    _, _, records_before, found_before = native.stats()
    planned = [[forward_backward(x) for x in inputs] for _ in range(2)]
    keys, unplanned_keys, records, found = native.stats()
    assert (keys, unplanned_keys, records - records_before) == (4, 0, 4)  # a forward and a backward key per layout
    assert found - found_before == 2 * 2 * len(inputs) - keys
    native.ENABLED = False
    try:
        python = [forward_backward(x) for x in inputs]
    finally:
        native.ENABLED = True
    for calls in planned:
        for got, want in zip(calls, python):
            assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want))


def test_native_linear_in_a_cuda_graph_without_grad_and_refusing_double_backward():
    """The native linear under CUDA-graph capture (a key recorded eagerly, one first seen in the capture: tensor maps
    encoded into the graph's launches), no_grad (no autograd node) and inference_mode: the Python path's bits. With
    create_graph=True both paths give the same first-order gradients, and differentiating them again raises
    (mok::linear_backward has no autograd formula)."""
    from mok.kernels import native

    assert native.load() is not None
    native.clear()
    x, w, b = _randn(4096, 2048), _randn(5120, 2048, seed=1, scale=0.05), _randn(5120, seed=2)
    x_new_key = _randn(1024, 2048, seed=3)

    def calls():
        return [mok.linear(x, w), mok.linear(x, w, b), mok.linear(x_new_key, w)]

    native.ENABLED = False
    try:
        want = calls()
    finally:
        native.ENABLED = True
    mok.linear(x, w)
    mok.linear(x, w, b)
    _assert_captured_calls_give(calls, want)
    leaf = x.detach().requires_grad_()
    with torch.no_grad():
        no_grad = mok.linear(leaf, w)
    with torch.inference_mode():
        inference = mok.linear(x, w, b)
    assert no_grad.grad_fn is None and torch.equal(no_grad, want[0]) and torch.equal(inference, want[1])
    small_x, small_w = _randn(8, 64).requires_grad_(), _randn(32, 64, seed=1).requires_grad_()
    small_b = _randn(32, seed=2).requires_grad_()
    firsts = []
    for enabled in (True, False):
        native.ENABLED = enabled
        try:
            first = torch.autograd.grad(mok.linear(small_x, small_w, small_b).float().square().sum(),
                                        (small_x, small_w, small_b), create_graph=True)
            assert all(g.requires_grad for g in first)
            with pytest.raises(RuntimeError):
                first[0].sum().backward()
            firsts.append([g.detach() for g in first])
        finally:
            native.ENABLED = True
    assert all(torch.equal(a, b) for a, b in zip(*firsts))


class _TookThePythonPath(Exception):
    pass


def test_whole_calls_run_natively_and_leave_the_rest_to_python(monkeypatch):
    """mok.rms_norm's and mok.linear's plain eager CUDA calls of valid arguments run whole on the native path
    (mok/ops/dispatch.py, native_call): with the Python path's ops replaced by stubs that raise, they still give the
    Python path's bits, dtypes, shapes and autograd nodes (2-D and 3-D x, a residual of another dtype, a bias, with
    and without gradients, the gradients too), and a forward-mode tangent is refused. Every other call reaches
    Python: an observed name, a tensor subclass, a dispatch mode, an int eps (its result equal to eps as a float), and
    bad arguments, which raise mok's typed errors with the Python path's messages."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from mok.errors import UnsupportedError
    from mok.kernels import native
    from mok.ops import linear as linear_module
    from mok.ops import rms_norm as rms_norm_module

    assert native.load() is not None
    x, x3, r = _randn(300, 256, scale=3), _randn(5, 7, 256, seed=1), _randn(300, 256, seed=2)
    w_norm, w, b = _randn(256, seed=3), _randn(96, 256, seed=4, scale=0.06), _randn(96, seed=5)
    r_fp32 = _randn(300, 256, dtype=torch.float32, seed=6)

    def calls():
        """[(output or gradient, whether it has a grad_fn)] of plain calls, with and without gradients."""
        leaves = [t.detach().requires_grad_() for t in (x, w_norm, x3, w, b)]
        grad_x, grad_w_norm, grad_x3, grad_w, grad_b = leaves
        y, new_r = mok.rms_norm(grad_x, grad_w_norm, 1e-6, r_fp32)
        y3 = mok.linear(grad_x3, grad_w, grad_b)
        (y.float().square().sum() + new_r.float().sum() + y3.float().square().sum()).backward()
        out = [y, new_r, y3, mok.rms_norm(x, w_norm, 1e-6), mok.rms_norm(x3, w_norm, 1e-5), mok.linear(x, w, b),
               mok.linear(x3, w)]
        with torch.no_grad():
            out.append(mok.rms_norm(grad_x, grad_w_norm, 1e-6))
        return [(t.detach(), t.grad_fn is not None) for t in out] + [(leaf.grad, False) for leaf in leaves]

    monkeypatch.setattr(native, "ENABLED", False)
    want = calls()
    monkeypatch.setattr(native, "ENABLED", True)

    def took_python(*args):
        raise _TookThePythonPath()

    for module, op in ((rms_norm_module, "_rms_norm"), (rms_norm_module, "_fused_add_rms_norm"),
                       (linear_module, "_linear")):
        monkeypatch.setattr(module, op, took_python)
    got = calls()
    assert [(t.dtype, t.shape, recorded) for t, recorded in got] == [(t.dtype, t.shape, r) for t, r in want]
    assert [recorded for _, recorded in got[:8]] == [True] * 3 + [False] * 5
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(got, want))

    class Subclass(torch.Tensor):
        pass

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with mok.hooks.observe(lambda *_: None):
        with pytest.raises(_TookThePythonPath):
            mok.rms_norm(x, w_norm, 1e-6, name="norm")
        with pytest.raises(_TookThePythonPath):
            mok.linear(x, w, name="proj")
    for python_call in (lambda: mok.rms_norm(x.as_subclass(Subclass), w_norm, 1e-6),
                        lambda: mok.linear(x, w.as_subclass(Subclass)), lambda: mok.rms_norm(x, w_norm, 0),
                        lambda: mok.linear(x, w, b.as_subclass(Subclass))):
        with pytest.raises(_TookThePythonPath):
            python_call()
    with Mode(), pytest.raises(_TookThePythonPath):
        mok.rms_norm(x, w_norm, 1e-6)
    monkeypatch.undo()
    assert torch.equal(mok.rms_norm(x, w_norm, 1), mok.rms_norm(x, w_norm, 1.0))
    # A forward-mode tangent is refused (C++ Functions have no jvp), not dropped, also where nothing requires grad.
    with torch.autograd.forward_ad.dual_level(), pytest.raises(RuntimeError, match="jvp"):
        mok.rms_norm(torch.autograd.forward_ad.make_dual(x, torch.ones_like(x)), w_norm, 1e-6)
    bad_calls = [
        (lambda: mok.rms_norm(x, w_norm[:128], 1e-6), "rms_norm: weight (128,) must be [256]"),
        (lambda: mok.rms_norm(x, w_norm, -1.0), "rms_norm: eps must be >= 0"),
        (lambda: mok.rms_norm(x, w_norm, float("nan")), "rms_norm: eps must be a finite real number"),
        (lambda: mok.rms_norm(x, w_norm, 1e-6, r[:5]), "rms_norm: residual (5, 256) must match x"),
        (lambda: mok.rms_norm(x, w_norm.cpu(), 1e-6), "all inputs must be on one device"),
        (lambda: mok.rms_norm(x.int(), w_norm, 1e-6), "rms_norm: dtypes torch.int32"),
        (lambda: mok.linear(x, w[:, :128]), "linear: x (300, 256) does not match weight (96, 128)"),
        (lambda: mok.linear(x, w, b[:5]), "linear: bias (5,) must be [96]"),
        (lambda: mok.linear(x, w.T.contiguous()), "does not match weight"),
    ]
    for bad_call, message in bad_calls:
        with pytest.raises(UnsupportedError, match=re.escape(message)):
            bad_call()


def test_rotary_and_silu_and_mul_batch_invariant():
    x = _randn(4096, 32, 128)
    pos = torch.randint(0, 40000, (4096,), device=DEVICE)
    out = _assert_rows_invariant(lambda x_, p_: mok.rotary(x_, p_, 1e6), x, pos)
    cpu = mok.rotary(x[:64].cpu(), pos[:64].cpu(), 1e6)
    torch.testing.assert_close(out[:64].cpu().float(), cpu.float(), atol=2e-2, rtol=2e-2)
    h = _randn(4096, 2 * 768, scale=3)
    out = _assert_rows_invariant(mok.silu_and_mul, h)
    torch.testing.assert_close(out.cpu().float(), mok.silu_and_mul(h.cpu()).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rotary_table_keeps_the_per_token_fp64_bits(dtype):
    """The cached cos/sin table (mok/kernels/rotary.py) gives the bits of the per-token fp64 formula (the kernel
    before the table, tests/helpers/rotary_per_token.py), forward and backward, on and off the table."""
    from mok.kernels import rotary as kernels
    from tests.helpers import rotary_per_token as before

    edge = [0, 1, 2, 4095, 4096, 32767, 32768, 65535, 131071, 131072, 262143, 2**24 + 1, -3]
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    positions = torch.cat([torch.tensor(edge, device=DEVICE),
                           torch.randint(0, 300000, (4096 - len(edge),), device=DEVICE, generator=gen)])
    for heads, head_dim, rotary_dim, theta, neox in ((32, 128, 128, 1e6, True), (5, 128, 128, 1e6, True),
                                                     (4, 64, 32, 5e5, True), (3, 40, 24, 1e4, False)):
        x = _randn(positions.shape[0], heads, head_dim, dtype=dtype, seed=heads)
        for inverse in (False, True):
            want = before.rotary(x, positions, theta, rotary_dim, neox, inverse)
            kernels.clear_tables()
            label = (heads, head_dim, rotary_dim, neox, inverse)
            # the table sized from T (4096 rows): the larger positions per token
            assert torch.equal(kernels.rotary(x, positions, theta, rotary_dim, neox, inverse), want), label
            # a table of 2^18 rows: every position but 2^24 + 1 and -3 from the table
            got = kernels.rotary(x, positions, theta, rotary_dim, neox, inverse, max_positions=1 << 18)
            assert kernels._TABLE_CACHE[(theta, rotary_dim, x.device)].shape[0] == 1 << 18
            assert torch.equal(got, want), label
            assert torch.equal(kernels.rotary(x, positions, theta, rotary_dim, neox, inverse, use_table=False),
                               want), label
    # the op: forward, and the gradient through autograd (the inverse rotation)
    x = _randn(positions.shape[0], 32, 128, dtype=dtype).requires_grad_()
    grad = _randn(positions.shape[0], 32, 128, dtype=dtype, seed=9)
    out = mok.rotary(x, positions, 1e6, max_positions=1 << 18)
    out.backward(grad)
    assert torch.equal(out, before.rotary(x.detach(), positions, 1e6, 128, True, False))
    assert torch.equal(x.grad, before.rotary(grad, positions, 1e6, 128, True, True))


@pytest.mark.parametrize("vocab", [151936, 2048])
def test_logprobs_batch_invariant_and_accurate(vocab):
    x = _randn(1024 if vocab > 100000 else 4096, vocab, scale=4)
    ids = torch.randint(0, vocab, (x.shape[0],), device=DEVICE)
    full = _assert_rows_invariant(log_softmax, x)
    picked = _assert_rows_invariant(logprobs, x, ids)
    assert torch.equal(picked, full.gather(1, ids[:, None])[:, 0])
    torch.testing.assert_close(full[:64].double(), torch.log_softmax(x[:64].double(), -1), atol=5e-5, rtol=1e-5)


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("hq,hkv,d", [(32, 4, 128), (16, 16, 64), (8, 2, 256)])
def test_attention_prefill_chunked_decode_bitwise(hq, hkv, d):
    lengths = [1100, 1, 64, 65, 300, 17]
    n = sum(lengths)
    q, k, v = _randn(n, hq, d), _randn(n, hkv, d, seed=1), _randn(n, hkv, d, seed=2)
    cu = _cu(lengths)
    scale = d**-0.5
    prefill = attention(q, k, v, cu, cu, scale)
    assert torch.equal(attention(q, k, v, cu, cu, scale), prefill), "rerun"
    starts = cu.tolist()
    for b, length in enumerate(lengths):
        s = starts[b]
        qs, ks, vs = q[s : s + length], k[s : s + length], v[s : s + length]
        assert torch.equal(attention(qs, ks, vs, _cu([length]), _cu([length]), scale), prefill[s : s + length])
        for chunk in (37, 100):
            pieces = [
                attention(
                    qs[c : c + chunk],
                    ks[: c + chunk],
                    vs[: c + chunk],
                    _cu([min(chunk, length - c)]),
                    _cu([min(c + chunk, length)]),
                    scale,
                )
                for c in range(0, length, chunk)
            ]
            assert torch.equal(torch.cat(pieces), prefill[s : s + length]), f"seq {b} chunk {chunk}"
    # token-by-token decode of the longest sequence, alone and in batches of 1..256 copies
    s, length = starts[0], lengths[0]
    for step in (0, 1, 62, 63, 64, 500, 1099):
        for copies in (1, 3, 256):
            out = attention(
                q[s + step : s + step + 1].repeat(copies, 1, 1),
                k[s : s + step + 1].repeat(copies, 1, 1),
                v[s : s + step + 1].repeat(copies, 1, 1),
                _cu([1] * copies),
                _cu([step + 1] * copies),
                scale,
            )
            assert (out == prefill[s + step]).all(), f"decode step {step}, {copies} copies"
    # accuracy against fp32 softmax attention on the longest sequence
    qs, ks, vs = (t[s : s + length].float().transpose(0, 1) for t in (q, k, v))
    ks, vs = ks.repeat_interleave(hq // hkv, 0), vs.repeat_interleave(hq // hkv, 0)
    scores = (qs @ ks.transpose(1, 2) * scale).masked_fill(
        torch.ones(length, length, device=DEVICE, dtype=torch.bool).triu(1), -torch.inf
    )
    expected = (scores.softmax(-1) @ vs).transpose(0, 1)
    torch.testing.assert_close(prefill[s : s + length].float(), expected, atol=2e-2, rtol=2e-2)


def _torch_rotary(x, positions, theta):
    d = x.shape[-1]
    angle = positions.double()[:, None, None] / theta ** (
        torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d
    )
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def test_backwards_deterministic_and_correct():
    torch.manual_seed(0)
    x, w, b = (
        _randn(300, 256, dtype=torch.float32),
        _randn(96, 256, dtype=torch.float32, seed=1, scale=1 / 16),
        _randn(96, dtype=torch.float32, seed=2),
    )
    lengths = [70, 1, 130]
    q, k, v = (
        _randn(201, 8, 64, dtype=torch.float32, seed=3),
        _randn(201, 2, 64, dtype=torch.float32, seed=4),
        _randn(201, 2, 64, dtype=torch.float32, seed=5),
    )
    weight = _randn(256, dtype=torch.float32, seed=6)

    def run(dtype, use_mok=True):
        leaves = [t.to(dtype).detach().requires_grad_() for t in (x, w, b, q, k, v, weight)]
        xx, ww, bb, qq, kk, vv, nw = leaves
        if use_mok:
            h = mok.silu_and_mul(mok.linear(mok.rms_norm(xx, nw, 1e-6), ww, bb))
            a = attention(
                mok.rotary(qq, torch.arange(201, device=DEVICE), 1e4), kk, vv, _cu(lengths), _cu(lengths), 0.125
            )
            lp = logprobs(h, torch.arange(300, device=DEVICE) % 48)
        else:
            hn = xx / torch.sqrt(xx.square().mean(-1, keepdim=True) + 1e-6) * nw
            y = hn @ ww.t() + bb
            h = torch.nn.functional.silu(y[:, :48]) * y[:, 48:]
            qr = _torch_rotary(qq, torch.arange(201, device=DEVICE), 1e4)
            outs = []
            for s0, s1 in zip(_cu(lengths).tolist()[:-1], _cu(lengths).tolist()[1:]):
                qs, ks, vs = (
                    qr[s0:s1].transpose(0, 1),
                    kk[s0:s1].transpose(0, 1).repeat_interleave(4, 0),
                    vv[s0:s1].transpose(0, 1).repeat_interleave(4, 0),
                )
                mask = torch.ones(s1 - s0, s1 - s0, device=DEVICE, dtype=torch.bool).triu(1)
                outs.append(
                    ((qs @ ks.transpose(1, 2) * 0.125).masked_fill(mask, -torch.inf).softmax(-1) @ vs).transpose(0, 1)
                )
            a = torch.cat(outs)
            lp = torch.log_softmax(h, -1).gather(1, (torch.arange(300, device=DEVICE) % 48)[:, None])[:, 0]
        (lp.float().sum() + a.float().square().sum() + h.float().square().sum()).backward()
        return [t.grad for t in leaves]

    first, second = run(torch.bfloat16), run(torch.bfloat16)
    for g1, g2 in zip(first, second):
        assert torch.equal(g1, g2)
    ours, ref = run(torch.float32), run(torch.float64, use_mok=False)
    for g1, g2 in zip(ours, ref):
        torch.testing.assert_close(g1.double(), g2, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_logprobs_backward_equals_the_log_softmax_backward_bitwise(dtype):
    """The CUDA backward of mok.logprobs (one kernel from the logits, no fp32 [T, V]) gives the bits of the
    log_softmax backward applied to a one-hot gradient."""
    from mok.ops import logprobs as ops

    gen = torch.Generator(device=DEVICE).manual_seed(4)
    logits_TV = (torch.randn(300, 5003, device=DEVICE, generator=gen) * 4).to(dtype)
    ids_T = torch.randint(0, 5003, (300,), device=DEVICE, generator=gen)
    grad_T = torch.randn(300, device=DEVICE, generator=gen)
    one_hot_TV = torch.zeros(300, 5003, device=DEVICE).scatter(1, ids_T[:, None], grad_T[:, None])
    want = ops._log_softmax_backward_op(one_hot_TV, ops._log_softmax_op(logits_TV)).to(dtype)
    assert torch.equal(ops._logprobs_backward_op(grad_T, logits_TV, ids_T), want)


@pytest.mark.parametrize("t,k,n", [(4096, 2048, 5120), (1500, 2048, 123), (5, 123, 123), (2048, 768, 64)])
def test_linear_every_config_and_layout_gives_the_same_bits(t, k, n):
    """Every CONFIGS entry of the matmul (pointer or TMA loads, mma.sync or wgmma tiles) gives the same bits
    for the forward (x @ w.T), d x (d y @ w) and d w (d y.T @ x) layouts, bf16 and fp16."""
    from mok.kernels import linear as kernels

    for dtype in (torch.bfloat16, torch.float16):
        x, w, g = _randn(t, k, dtype=dtype), _randn(n, k, dtype=dtype, seed=1), _randn(t, n, dtype=dtype, seed=2)
        for a, b in ((x, w.t()), (g, w), (g.t(), x)):
            outs = {name: kernels.matmul(a, b, config=config) for name, config in kernels.CONFIGS.items()
                    if name != "fp32"}
            outs["pointers"] = kernels.matmul(a, b, config=dict(kernels.CONFIGS["large"], TMA=0))
            first = next(iter(outs.values()))
            assert all(torch.equal(out, first) for out in outs.values()), [name for name in outs]
            torch.testing.assert_close(first.float(), (a.double() @ b.double()).to(dtype).float(), atol=3e-2, rtol=2e-2)
