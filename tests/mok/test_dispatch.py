"""mok/ops/dispatch.py: an eager call that runs an op's implementation directly gives the bits of the same call
through the torch.library custom op (outputs and every gradient), the direct path is really taken in plain
eager calls, and every traced, moded or transformed call still reaches the op."""
import pytest
import torch

import mok
from mok.ops import attention, dispatch, moe, rms_norm, rotary

DEVICE = "cpu"  # where the cases put their tensors (the CUDA test sets it)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _leaf(*shape, dtype=torch.float32, seed=0, scale=1.0):
    value = torch.randn(*shape, generator=_gen(seed + sum(shape))) * scale
    return value.to(dtype=dtype, device=DEVICE).requires_grad_()


def _ints(values):
    return torch.tensor(values, device=DEVICE)


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def _moe_inputs(num_tokens=7, hidden=24, inter=10, experts=6, dtype=torch.float32):
    return (_leaf(num_tokens, hidden, dtype=dtype, seed=1), _leaf(num_tokens, experts, seed=2),
            _leaf(experts, 2 * inter, hidden, dtype=dtype, seed=3, scale=0.2),
            _leaf(experts, hidden, inter, dtype=dtype, seed=4, scale=0.2))


def _rms_norm_residual_other_dtype():
    x, w = _leaf(5, 123, dtype=torch.bfloat16), _leaf(123, seed=1, scale=0.1)
    residual = _leaf(5, 123, dtype=torch.float16, seed=2)
    return (x, w, residual), lambda: mok.rms_norm(x, w, 1e-6, residual)


def _moe_replay():
    x, logits, w13, w2 = _moe_inputs()
    ids = _ints([[0, 3], [5, 1], [2, 2], [4, 0], [1, 5], [3, 4], [0, 1]])
    return (x, logits, w13, w2), lambda: mok.moe(x, logits, w13, w2, 2, topk_ids=ids)


def _moe_given_weights():
    x, logits, w13, w2 = _moe_inputs(dtype=torch.bfloat16)
    ids = _ints([[0, 3], [5, 1], [2, 4], [4, 0], [1, 5], [3, 4], [0, 1]])
    weights = _leaf(7, 2, seed=9)
    return (x, w13, w2, weights), lambda: mok.moe(x, logits, w13, w2, 2, topk_ids=ids, topk_weights=weights)


def _attention():
    q, k, v = _leaf(9, 4, 16), _leaf(9, 2, 16, seed=1), _leaf(9, 2, 16, seed=2)
    cu = _cu([4, 5])
    return (q, k, v), lambda: mok.attention(q, k, v, cu, cu, 0.25)


CASES = {
    "rms_norm": lambda: (lambda x, w: ((x, w), lambda: mok.rms_norm(x, w, 1e-6)))(
        _leaf(5, 123, dtype=torch.bfloat16), _leaf(123, seed=1, scale=0.1)),
    "rms_norm_residual": lambda: (lambda x, w, r: ((x, w, r), lambda: mok.rms_norm(x, w, 1e-6, r)))(
        _leaf(5, 123), _leaf(123, seed=1), _leaf(5, 123, seed=2)),
    "rms_norm_residual_other_dtype": _rms_norm_residual_other_dtype,
    "linear": lambda: (lambda x, w, b: ((x, w, b), lambda: mok.linear(x, w, b)))(
        _leaf(5, 3, 24), _leaf(7, 24, seed=1), _leaf(7, seed=2)),
    "linear_no_bias": lambda: (lambda x, w: ((x, w), lambda: mok.linear(x, w)))(
        _leaf(5, 24, dtype=torch.bfloat16), _leaf(7, 24, dtype=torch.bfloat16, seed=1)),
    "head_linear": lambda: (lambda x, w: ((x, w), lambda: mok.head_linear(x, w)))(
        _leaf(5, 3, 24, dtype=torch.bfloat16), _leaf(3, 7, 24, dtype=torch.bfloat16, seed=1)),
    "rotary": lambda: (lambda x: ((x,), lambda: mok.rotary(x, _ints([0, 7, 3, 100, 2]), 1e4, 12)))(
        _leaf(5, 3, 16)),
    "silu_and_mul": lambda: (lambda x: ((x,), lambda: mok.silu_and_mul(x)))(_leaf(5, 2 * 61)),
    "log_softmax": lambda: (lambda x: ((x,), lambda: mok.log_softmax(x)))(_leaf(5, 123, dtype=torch.bfloat16)),
    "logprobs": lambda: (lambda x: ((x,), lambda: mok.logprobs(x, _ints([0, 122, 5, 7, 1]))))(
        _leaf(5, 123)),
    "attention": _attention,
    "route": lambda: (lambda logits: ((logits,), lambda: mok.route(logits, 3)[1]))(_leaf(7, 8)),
    "moe": lambda: (lambda x, logits, w13, w2: ((x, logits, w13, w2), lambda: mok.moe(x, logits, w13, w2, 2)))(
        *_moe_inputs()),
    "moe_replay": _moe_replay,
    "moe_given_weights": _moe_given_weights,
}


def _run(case: str, grad: bool):
    leaves, call = CASES[case]()
    with torch.set_grad_enabled(grad):
        out = call()
    outs = out if isinstance(out, tuple) else (out,)
    if not grad:
        return [o.clone() for o in outs]
    gen = _gen(7)
    grads = [torch.randn(o.shape, generator=gen).to(dtype=o.dtype, device=o.device) for o in outs]
    torch.autograd.backward(outs, grads)
    return [o.detach().clone() for o in outs] + [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("grad", [True, False], ids=["forward+backward", "no_grad"])
@pytest.mark.parametrize("case", list(CASES))
def test_direct_call_gives_the_ops_bits(case, grad, monkeypatch):
    _compare_paths(case, grad, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("grad", [True, False], ids=["forward+backward", "no_grad"])
@pytest.mark.parametrize("case", list(CASES))
def test_direct_call_gives_the_ops_bits_on_cuda(case, grad, monkeypatch):
    """The same on CUDA tensors: the registered CUDA kernels run directly or through the ops."""
    monkeypatch.setitem(globals(), "DEVICE", "cuda")
    _compare_paths(case, grad, monkeypatch)


def _compare_paths(case, grad, monkeypatch):
    direct = _run(case, grad)
    monkeypatch.setattr(dispatch, "ENABLED", False)
    through_op = _run(case, grad)
    assert len(direct) == len(through_op)
    for got, want in zip(direct, through_op):
        assert got is not None and want is not None
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want) or (got.isnan() == want.isnan()).all() and torch.equal(
            got.nan_to_num(), want.nan_to_num())


class _Counted:
    """Stands for an EagerOp's custom op and counts the calls that reach it."""

    def __init__(self, op):
        self.op, self.calls = op, 0

    def __call__(self, *args):
        self.calls += 1
        return self.op(*args)


@pytest.fixture
def counted(monkeypatch):
    ops = {}
    for name, eager in [("rms_norm", rms_norm._rms_norm), ("rms_norm_backward", rms_norm._rms_norm_backward),
                        ("experts", moe._experts), ("experts_backward", moe._experts_backward_eager),
                        ("infer", moe._infer)]:
        ops[name] = _Counted(eager.op)
        monkeypatch.setattr(eager, "op", ops[name])
    return ops


def test_plain_eager_calls_skip_the_op(counted):
    x, w = _leaf(4, 16), _leaf(16, seed=1)
    mok.rms_norm(x, w, 1e-6).sum().backward()
    xm, logits, w13, w2 = _moe_inputs()
    mok.moe(xm, logits, w13, w2, 2).sum().backward()
    with torch.no_grad():
        mok.moe(xm, logits, w13, w2, 2)
    assert {name: op.calls for name, op in counted.items()} == dict.fromkeys(counted, 0)
    assert x.grad is not None and w13.grad is not None


def test_moded_calls_reach_the_op(counted):
    x, w = _leaf(4, 16), _leaf(16, seed=1)
    with torch.device("cpu"):  # a TorchFunctionMode
        y_mode = mok.rms_norm(x, w, 1e-6)
    assert counted["rms_norm"].calls == 1
    assert torch.equal(y_mode, mok.rms_norm(x, w, 1e-6))
    assert counted["rms_norm"].calls == 1
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    fake_x, fake_w = mode.from_tensor(x.detach()), mode.from_tensor(w.detach())
    with mode:  # a TorchDispatchMode, fake tensors
        fake = mok.rms_norm(fake_x, fake_w, 1e-6)
    assert counted["rms_norm"].calls == 2 and tuple(fake.shape) == (4, 16)
    rows = torch.vmap(lambda row: mok.rms_norm(row[None], w.detach(), 1e-6)[0])(x.detach())  # functorch
    assert counted["rms_norm"].calls == 3 and torch.equal(rows, mok.rms_norm(x.detach(), w.detach(), 1e-6))


def test_compiled_calls_reach_the_op(counted):
    x, w = _leaf(4, 16), _leaf(16, seed=1)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w: mok.rms_norm(x, w, 1e-6) * 2, fullgraph=True, backend="aot_eager")
    out = compiled(x, w)
    assert counted["rms_norm"].calls == 1  # dynamo traced the call into the op (once, while compiling)
    assert torch.equal(out, mok.rms_norm(x, w, 1e-6) * 2)


def test_missing_arguments_and_subclasses_go_to_the_op(monkeypatch):
    counted = _Counted(rotary._rotary.op)
    monkeypatch.setattr(rotary._rotary, "op", counted)
    x, positions = torch.randn(3, 2, 8), torch.arange(3)
    without_default = rotary._rotary(x, positions, 1e4, 8, True, False)  # max_positions left to its default
    assert counted.calls == 1
    assert torch.equal(without_default, rotary._rotary(x, positions, 1e4, 8, True, False, 0, None))  # every argument
    assert counted.calls == 1

    class Sub(torch.Tensor):
        pass

    rotary._rotary(x.as_subclass(Sub), positions, 1e4, 8, True, False, 0)
    assert counted.calls == 2


def test_whole_calls_ask_the_native_path_only_for_plain_cuda_calls(monkeypatch):
    """mok.rms_norm and mok.linear ask for the native path's whole call (dispatch.native_call) only when their first
    tensor is a plain CUDA tensor in a plain mode: CPU calls never load the extension (the CUDA side:
    tests/mok/test_dense_gpu.py)."""
    asked = []
    monkeypatch.setattr(dispatch, "_native_function", asked.append)
    x, w, w_linear = _leaf(4, 16), _leaf(16, seed=1), _leaf(3, 16, seed=2)
    mok.rms_norm(x, w, 1e-6)
    mok.rms_norm(x, w, 1e-6, x.detach())
    mok.linear(x, w_linear).sum().backward()
    assert asked == [] and x.grad is not None
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # a plain first tensor "on CUDA"
    assert dispatch.native_call("rms_norm_call", x, w, 1e-6, None) is None and asked == ["rms_norm_call"]
    with torch.device("cpu"):  # a TorchFunctionMode: not asked
        assert dispatch.native_call("rms_norm_call", x, w, 1e-6, None) is None and asked == ["rms_norm_call"]
    monkeypatch.setattr(dispatch, "ENABLED", False)
    assert dispatch.native_call("rms_norm_call", x, w, 1e-6, None) is None and asked == ["rms_norm_call"]


def test_mutating_ops_are_refused():
    with pytest.raises(ValueError, match="mutates"):
        dispatch.register(attention._write_kv_cache_op)


def test_cuda_implementations_run_on_their_tensors_device(monkeypatch):
    """on_tensors_device: a CUDA implementation runs with its first tensor's device current (Triton launches on the
    current device), entered only when another device is current; the registered ops' CUDA implementations are
    wrapped. CUDA tensors are stood in for (this runs on CPU machines): what is checked is which device is current
    when the implementation runs."""
    from unittest import mock

    current = {"index": 0}

    class _Device:
        def __init__(self, index):
            self.index, self.saved = index, None

        def __enter__(self):
            self.saved, current["index"] = current["index"], self.index

        def __exit__(self, *exc):
            current["index"] = self.saved

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current["index"])
    monkeypatch.setattr(torch.cuda, "device", _Device)

    def cuda_tensor(index):
        t = mock.MagicMock(spec=torch.Tensor)
        t.is_cuda, t.device = True, torch.device("cuda", index)
        return t

    seen = []
    run = dispatch.on_tensors_device(lambda *args, **kwargs: seen.append((current["index"], kwargs)) or "out")
    assert run(None, 3, cuda_tensor(1), cuda_tensor(0), flag=True) == "out"  # the first tensor decides
    assert run(cuda_tensor(0)) == "out"
    assert run(torch.zeros(2), cuda_tensor(1)) == "out"  # a CPU tensor first: nothing to switch
    assert seen == [(1, {"flag": True}), (0, {}), (0, {})] and current["index"] == 0
    for eager_op in (rms_norm._rms_norm, moe._experts, moe._infer, attention._attention):
        assert eager_op.impls["cuda"].__wrapped__ is not None
