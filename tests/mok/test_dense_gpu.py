"""The dense ops' Triton paths on a CUDA GPU: batch invariance over batch sizes 1..4096, prefill ==
chunked prefill == decode for attention, rerun determinism (forward and backward), accuracy. The launch
plans and the native eager path: test_dense_gpu_native.py."""

import pytest
import torch

import mok
from mok.ops.attention import attention
from mok.ops.logprobs import log_softmax, logprobs
from tests.helpers.dense_gpu import DEVICE, randn

pytestmark = pytest.mark.gpu
BATCH_SIZES = [1, 2, 3, 7, 16, 64, 100, 511, 1000, 4096]


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
    x, w = randn(4096, k), randn(n, k, seed=1, scale=k**-0.5)
    full = _assert_rows_invariant(lambda x_: mok.linear(x_, w), x)
    torch.testing.assert_close(full.float(), (x.float() @ w.float().t()).bfloat16().float(), atol=2e-2, rtol=2e-2)


def test_linear_with_bias_fp32_and_fp16():
    for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 2e-3)):
        x, w, b = (
            randn(4096, 256, dtype=dtype),
            randn(96, 256, dtype=dtype, seed=1, scale=1 / 16),
            randn(96, dtype=dtype, seed=2),
        )
        full = _assert_rows_invariant(lambda x_: mok.linear(x_, w, b), x)
        torch.testing.assert_close(
            full.double(), (x.double() @ w.double().t() + b.double()).to(dtype).double(), atol=tol, rtol=tol
        )


def test_rms_norm_batch_invariant_and_accurate():
    x, r, w = randn(4096, 2048, scale=3), randn(4096, 2048, seed=1), randn(2048, seed=2)
    y = _assert_rows_invariant(lambda x_: mok.rms_norm(x_, w, 1e-6), x)
    xd = x.double()
    torch.testing.assert_close(
        y.float(),
        (xd / torch.sqrt(xd.square().mean(-1, keepdim=True) + 1e-6) * w.double()).float(),
        atol=3e-2,
        rtol=1.6e-2,
    )
    _assert_rows_invariant(lambda x_, r_: torch.cat(mok.rms_norm(x_, w, 1e-6, r_), -1), x, r)
    q = randn(4096, 32, 128)
    _assert_rows_invariant(lambda q_: mok.rms_norm(q_, w[:128], 1e-6), q)


def test_rotary_and_silu_and_mul_batch_invariant():
    x = randn(4096, 32, 128)
    pos = torch.randint(0, 40000, (4096,), device=DEVICE)
    out = _assert_rows_invariant(lambda x_, p_: mok.rotary(x_, p_, 1e6), x, pos)
    cpu = mok.rotary(x[:64].cpu(), pos[:64].cpu(), 1e6)
    torch.testing.assert_close(out[:64].cpu().float(), cpu.float(), atol=2e-2, rtol=2e-2)
    h = randn(4096, 2 * 768, scale=3)
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
        x = randn(positions.shape[0], heads, head_dim, dtype=dtype, seed=heads)
        for inverse in (False, True):
            want = before.rotary(x, positions, theta, rotary_dim, neox, inverse)
            kernels.clear_tables()
            label = (heads, head_dim, rotary_dim, neox, inverse)
            # the table sized from T (4096 rows): the larger positions per token
            assert torch.equal(kernels.rotary(x, positions, theta, rotary_dim, neox, inverse), want), label
            # a table of 2^18 rows: every position but 2^24 + 1 and -3 from the table
            got = kernels.rotary(x, positions, theta, rotary_dim, neox, inverse, max_positions=1 << 18)
            assert kernels._TABLE_CACHE[(theta, rotary_dim, None, x.device)].shape[0] == 1 << 18
            assert torch.equal(got, want), label
            assert torch.equal(kernels.rotary(x, positions, theta, rotary_dim, neox, inverse, use_table=False),
                               want), label
    # the op: forward, and the gradient through autograd (the inverse rotation)
    x = randn(positions.shape[0], 32, 128, dtype=dtype).requires_grad_()
    grad = randn(positions.shape[0], 32, 128, dtype=dtype, seed=9)
    out = mok.rotary(x, positions, 1e6, max_positions=1 << 18)
    out.backward(grad)
    assert torch.equal(out, before.rotary(x.detach(), positions, 1e6, 128, True, False))
    assert torch.equal(x.grad, before.rotary(grad, positions, 1e6, 128, True, True))


@pytest.mark.parametrize("vocab", [151936, 2048])
def test_logprobs_batch_invariant_and_accurate(vocab):
    x = randn(1024 if vocab > 100000 else 4096, vocab, scale=4)
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
    q, k, v = randn(n, hq, d), randn(n, hkv, d, seed=1), randn(n, hkv, d, seed=2)
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
        randn(300, 256, dtype=torch.float32),
        randn(96, 256, dtype=torch.float32, seed=1, scale=1 / 16),
        randn(96, dtype=torch.float32, seed=2),
    )
    lengths = [70, 1, 130]
    q, k, v = (
        randn(201, 8, 64, dtype=torch.float32, seed=3),
        randn(201, 2, 64, dtype=torch.float32, seed=4),
        randn(201, 2, 64, dtype=torch.float32, seed=5),
    )
    weight = randn(256, dtype=torch.float32, seed=6)

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
        x, w, g = randn(t, k, dtype=dtype), randn(n, k, dtype=dtype, seed=1), randn(t, n, dtype=dtype, seed=2)
        for a, b in ((x, w.t()), (g, w), (g.t(), x)):
            outs = {name: kernels.matmul(a, b, config=config) for name, config in kernels.CONFIGS.items()
                    if name != "fp32"}
            outs["pointers"] = kernels.matmul(a, b, config=dict(kernels.CONFIGS["large"], TMA=0))
            first = next(iter(outs.values()))
            assert all(torch.equal(out, first) for out in outs.values()), [name for name in outs]
            torch.testing.assert_close(first.float(), (a.double() @ b.double()).to(dtype).float(), atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("t", [1, 7, 64, 4096])
@pytest.mark.parametrize("heads", [128, 16])
@pytest.mark.parametrize("product", ["absorb", "project"])
def test_head_linear_is_each_heads_linear(t, heads, product):
    """MLA's absorption ([T, Q, M] x W_UK^T -> [T, Q, A]) and output projection ([T, Q, A] x W_UV -> [T, Q, W]) at
    DeepSeek-V3 (128 heads) and Moonlight (16) widths, the weights strided views of one kv_b_proj [Q, M + W, A] as
    rl/models/mla.py reads them: each head's output, d x and d w equal mok.linear's on that head alone, at decode
    and training row counts."""
    nope, value, latent = 128, 128, 512
    kv_b_QNA = randn(heads, nope + value, latent, seed=1, scale=0.05)
    w_QOF = kv_b_QNA[:, :nope].transpose(1, 2) if product == "absorb" else kv_b_QNA[:, nope:]
    x = randn(t, heads, w_QOF.shape[2]).requires_grad_()
    w = w_QOF.detach().requires_grad_()
    got = mok.head_linear(x, w)
    grad = randn(t, heads, w_QOF.shape[1], seed=2)
    got.backward(grad)
    for h in range(heads):
        xh, wh = x[:, h].detach().requires_grad_(), w_QOF[h].detach().requires_grad_()
        want = mok.linear(xh, wh)
        want.backward(grad[:, h])
        assert torch.equal(got[:, h], want), h
        assert torch.equal(x.grad[:, h], xh.grad) and torch.equal(w.grad[h], wh.grad), h
