"""mok.rms_norm and mok.linear on CUDA through their launch plans (mok/kernels/launch_plans.py) and the native
eager path (mok/kernels/native): every planned or native call has the bits of the unplanned Python path, inside CUDA
graphs and without grad too; whole calls run natively and leave the rest to Python."""

import re

import pytest
import torch

import mok
from tests.helpers.dense_gpu import randn

pytestmark = pytest.mark.gpu


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
    base = randn(num_tokens * hidden + 1, scale=3)
    residual = randn(num_tokens, hidden, seed=4)
    grads = (randn(num_tokens, hidden, seed=5), randn(num_tokens, hidden, seed=6))
    cases = [(x, randn(hidden, seed=seed), r) for x in (base[:-1].view(num_tokens, hidden),
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
    buffer = randn(rows, 2 * hidden, scale=3)
    other = randn(rows, hidden, seed=7)
    weight = randn(hidden, seed=2)
    grads = (randn(rows, hidden, seed=5), randn(rows, hidden, seed=6))
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
    x, r, w = randn(512, 2048, scale=3), randn(512, 2048, seed=1), randn(2048, seed=2)
    x_new_key = randn(48, 2048, seed=3)

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
    x, w = randn(64, 256, scale=3).requires_grad_(), randn(256, seed=2).requires_grad_()
    plain = torch.autograd.grad(mok.rms_norm(x, w, 1e-6).float().square().sum(), (x, w))
    for residual in (None, randn(64, 256, seed=3).requires_grad_()):
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
    x, w, g = randn(4096, 2048, scale=3), randn(2048, seed=2, dtype=torch.float32), randn(4096, 2048, seed=5)

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
    x, r, w = randn(256, 2048, scale=3), randn(256, 2048, seed=1), randn(2048, seed=2)
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
    buffer = randn(t, 2 * f, dtype=x_dtype, scale=2)
    w, grad = randn(o, f, dtype=w_dtype, seed=1, scale=0.05), randn(t, o, dtype=x_dtype, seed=3)
    bias = None if bias_dtype is None else randn(o, dtype=bias_dtype, seed=2)
    inputs = [randn(t, f, dtype=x_dtype, seed=4, scale=2), buffer[:, f:]]  # (strides (F, 1) and (2F, 1): two keys)

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
    x, w, b = randn(4096, 2048), randn(5120, 2048, seed=1, scale=0.05), randn(5120, seed=2)
    x_new_key = randn(1024, 2048, seed=3)

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
    small_x, small_w = randn(8, 64).requires_grad_(), randn(32, 64, seed=1).requires_grad_()
    small_b = randn(32, seed=2).requires_grad_()
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
    x, x3, r = randn(300, 256, scale=3), randn(5, 7, 256, seed=1), randn(300, 256, seed=2)
    w_norm, w, b = randn(256, seed=3), randn(96, 256, seed=4, scale=0.06), randn(96, seed=5)
    r_fp32 = randn(300, 256, dtype=torch.float32, seed=6)

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
