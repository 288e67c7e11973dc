"""Triton kernel logic of the dense ops, run on the CPU under TRITON_INTERPRET=1.

The interpreter must be switched on before Triton builds the kernels, and must not leak into other
tests (on a GPU machine it would turn real kernels into interpreted ones), so the outer test reruns
this file in a subprocess with the variable set. Triton 3.9's interpreter mishandles bf16 (tl.dot on
bf16 operands returns garbage, casts to bf16 truncate), so these tests use fp16 and fp32; bf16 runs
on the GPU tests (test_dense_gpu.py).
"""
import os
import subprocess
import sys

import pytest
import torch

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


if not INTERPRETING:

    def test_kernels_under_triton_interpreter():
        pytest.importorskip("triton")
        env = dict(os.environ, TRITON_INTERPRET="1")
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                                env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
        assert " passed" in result.stdout

else:
    from mok.kernels import attention as attention_kernels
    from mok.kernels import linear as linear_kernels
    from mok.kernels import logprobs as logprobs_kernels
    from mok.kernels import rms_norm as rms_norm_kernels
    from mok.kernels import rotary as rotary_kernels
    from mok.kernels import silu_and_mul as silu_kernels
    from mok.reference import attention as attention_reference
    from mok.reference import logprobs as logprobs_reference
    from mok.reference import rms_norm as rms_norm_reference
    from mok.reference import rotary as rotary_reference
    from mok.reference import silu_and_mul as silu_reference

    TOL = {torch.float16: dict(atol=2e-3, rtol=2e-3), torch.float32: dict(atol=2e-5, rtol=2e-5)}

    def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
        return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)

    @pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
    @pytest.mark.parametrize("t,k,n", [(70, 50, 33), (1, 16, 130)])
    def test_linear_kernel(t, k, n, dtype):
        x, w, b = _randn(t, k, dtype=dtype), _randn(n, k, dtype=dtype, seed=1, scale=k**-0.5), _randn(n, dtype=dtype, seed=2)
        out = linear_kernels.linear(x, w, b)
        expected = (x.double() @ w.double().t() + b.double()).to(dtype)
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), expected.double(), **TOL[dtype])
        for i in (0, t - 1):
            assert torch.equal(linear_kernels.linear(x[i : i + 1], w, b)[0], out[i])

    def test_batched_strided_matmul():
        a, b = _randn(3, 7, 40), _randn(3, 11, 40, seed=1)
        out = linear_kernels.matmul(a, b.transpose(1, 2), out_dtype=torch.float32)
        torch.testing.assert_close(out.double(), a.double() @ b.double().transpose(1, 2), atol=2e-5, rtol=2e-5)

    @pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
    @pytest.mark.parametrize("with_residual", [False, True])
    def test_rms_norm_kernel(dtype, with_residual):
        x, r, w = _randn(9, 45, dtype=dtype, scale=3), _randn(9, 45, dtype=dtype, seed=1), _randn(45, dtype=dtype, seed=2)
        y, new_r = rms_norm_kernels.rms_norm(x, r if with_residual else None, w, 1e-6)
        if with_residual:
            y_ref, r_ref = rms_norm_reference.fused_add_rms_norm(x, r, w, 1e-6)
            assert torch.equal(new_r, r_ref)
        else:
            y_ref = rms_norm_reference.rms_norm(x, w, 1e-6)
        torch.testing.assert_close(y.double(), y_ref.double(), **TOL[dtype])
        assert torch.equal(rms_norm_kernels.rms_norm(x[4:5], r[4:5] if with_residual else None, w, 1e-6)[0][0], y[4])

    @pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
    @pytest.mark.parametrize("neox", [True, False])
    @pytest.mark.parametrize("rotary_dim", [20, 12])
    @pytest.mark.parametrize("inverse", [False, True])
    def test_rotary_kernel(dtype, neox, rotary_dim, inverse):
        x = _randn(5, 3, 20, dtype=dtype)
        pos = torch.randint(0, 5000, (5,), generator=torch.Generator().manual_seed(3))
        out = rotary_kernels.rotary(x, pos, 1e4, rotary_dim, neox, inverse)
        expected = rotary_reference.rotary(x, pos, 1e4, rotary_dim, neox, inverse)
        torch.testing.assert_close(out.double(), expected.double(), **TOL[dtype])
        assert torch.equal(out[:, :, rotary_dim:], x[:, :, rotary_dim:])
        assert torch.equal(rotary_kernels.rotary(x[2:3], pos[2:3], 1e4, rotary_dim, neox, inverse)[0], out[2])

    @pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
    def test_silu_and_mul_kernel(dtype):
        x = _randn(6, 70, dtype=dtype, scale=4)
        out = silu_kernels.silu_and_mul(x)
        torch.testing.assert_close(out.double(), silu_reference.silu_and_mul(x).double(), **TOL[dtype])
        assert torch.equal(silu_kernels.silu_and_mul(x[3:4])[0], out[3])

    @pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
    @pytest.mark.parametrize("v", [5000, 37])
    def test_logprobs_kernels(dtype, v):
        x = _randn(4, v, dtype=dtype, scale=4)
        ids = torch.randint(0, v, (4,), generator=torch.Generator().manual_seed(5))
        out = logprobs_kernels.log_softmax(x)
        torch.testing.assert_close(out.double(), logprobs_reference.log_softmax(x).double(), atol=1e-5, rtol=1e-5)
        picked = logprobs_kernels.logprobs(x, ids)
        assert torch.equal(picked, out.gather(1, ids[:, None])[:, 0])
        assert torch.equal(logprobs_kernels.log_softmax(x[2:3])[0], out[2])

    @pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
    @pytest.mark.parametrize("causal", [True, False])
    def test_attention_kernel_matches_reference(dtype, causal):
        lens_q, lens_k = [3, 1, 70, 0], [5, 80, 70, 2]
        q = _randn(sum(lens_q), 4, 16, dtype=dtype)
        k, v = _randn(sum(lens_k), 2, 16, dtype=dtype, seed=1), _randn(sum(lens_k), 2, 16, dtype=dtype, seed=2)
        out, lse = attention_kernels.attention_forward(q, k, v, _cu(lens_q), _cu(lens_k), 0.25, causal)
        out_ref, lse_ref = attention_reference.attention_forward(q, k, v, _cu(lens_q), _cu(lens_k), 0.25, causal)
        torch.testing.assert_close(out.double(), out_ref.double(), **TOL[dtype])
        torch.testing.assert_close(lse, lse_ref, atol=1e-5, rtol=1e-5)

    def test_attention_kernel_prefill_chunked_decode_bitwise():
        """The key-loop logic: a tile running past a query's last key leaves it unchanged. The
        interpreter's tl.dot is numpy's BLAS matmul, whose rows depend on their position in the tile,
        so here each query keeps its tile row (0 for decode: queries 0 and 64); the GPU tests check
        every query at every tile position."""
        length = 70
        q = _randn(length, 4, 16, dtype=torch.float16)
        k, v = _randn(length, 2, 16, dtype=torch.float16, seed=1), _randn(length, 2, 16, dtype=torch.float16, seed=2)
        full, full_lse = attention_kernels.attention_forward(q, k, v, _cu([length]), _cu([length]), 0.25, True)
        for i in (0, 64):
            one, one_lse = attention_kernels.attention_forward(q[i : i + 1], k[: i + 1], v[: i + 1], _cu([1]), _cu([i + 1]), 0.25, True)
            assert torch.equal(one[0], full[i]) and torch.equal(one_lse[0], full_lse[i])
        # queries 64..69 as a chunk whose tile also covers the keys after each query's last one
        chunk, chunk_lse = attention_kernels.attention_forward(q[64:], k, v, _cu([6]), _cu([length]), 0.25, True)
        assert torch.equal(chunk, full[64:]) and torch.equal(chunk_lse, full_lse[64:])
        # a two-sequence batch: the second sequence's rows sit at the same tile rows as alone
        both, _ = attention_kernels.attention_forward(torch.cat([q[:3], q]), torch.cat([k[:3], k]), torch.cat([v[:3], v]),
                                                      _cu([3, length]), _cu([3, length]), 0.25, True)
        assert torch.equal(both[3:], full)
