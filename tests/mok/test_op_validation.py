"""Every op's parameters are validated with a typed mok.UnsupportedError naming the parameter (attention:
tests/mok/test_attention.py). CPU; the checks run before any kernel, so they hold on CUDA too."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import mok
from mok.ops.rotary import YarnScaling
from mok.ops.routing import replay_weights

INF, NAN = math.inf, math.nan


def x_TF(*shape):
    return torch.randn(*shape) if shape else torch.randn(3, 8)


# (call, fragment of the message that names the problem)
BAD = {
    # rms_norm
    "rms_norm eps negative": (lambda: mok.rms_norm(x_TF(), torch.ones(8), -1e-6), "eps"),
    "rms_norm eps nan": (lambda: mok.rms_norm(x_TF(), torch.ones(8), NAN), "eps"),
    "rms_norm eps inf": (lambda: mok.rms_norm(x_TF(), torch.ones(8), INF), "eps"),
    "rms_norm eps string": (lambda: mok.rms_norm(x_TF(), torch.ones(8), "1e-6"), "eps"),
    "rms_norm eps bool": (lambda: mok.rms_norm(x_TF(), torch.ones(8), True), "eps"),
    "rms_norm eps tensor": (lambda: mok.rms_norm(x_TF(), torch.ones(8), torch.tensor(1e-6)), "eps"),
    "rms_norm eps with residual": (lambda: mok.rms_norm(x_TF(), torch.ones(8), -1.0, x_TF()), "eps"),
    "rms_norm x not a tensor": (lambda: mok.rms_norm([[1.0]], torch.ones(1), 1e-6), "x must be a tensor"),
    "rms_norm weight not a tensor": (lambda: mok.rms_norm(x_TF(), None, 1e-6), "weight must be a tensor"),
    "rms_norm empty features": (lambda: mok.rms_norm(torch.randn(3, 0), torch.ones(0), 1e-6), "F > 0"),
    "rms_norm scalar x": (lambda: mok.rms_norm(torch.tensor(1.0), torch.ones(1), 1e-6), "F > 0"),
    "rms_norm residual dtype": (lambda: mok.rms_norm(x_TF(), torch.ones(8), 1e-6, torch.ones(3, 8, dtype=torch.int32)),
                                "residual dtype"),
    "rms_norm residual not a tensor": (lambda: mok.rms_norm(x_TF(), torch.ones(8), 1e-6, 1.0), "residual"),
    "rms_norm device": (lambda: mok.rms_norm(x_TF(), torch.ones(8, device="meta"), 1e-6), "device"),
    # rotary
    "rotary theta zero": (lambda: mok.rotary(x_TF(2, 1, 8), torch.arange(2), 0.0), "theta"),
    "rotary theta negative": (lambda: mok.rotary(x_TF(2, 1, 8), torch.arange(2), -1e4), "theta"),
    "rotary theta nan": (lambda: mok.rotary(x_TF(2, 1, 8), torch.arange(2), NAN), "theta"),
    "rotary theta inf": (lambda: mok.rotary(x_TF(2, 1, 8), torch.arange(2), INF), "theta"),
    "rotary theta none": (lambda: mok.rotary(x_TF(2, 1, 8), torch.arange(2), None), "theta"),
    "rotary theta bool": (lambda: mok.rotary(x_TF(2, 1, 8), torch.arange(2), True), "theta"),
    "rotary rotary_dim zero": (lambda: mok.rotary(x_TF(2, 1, 8), torch.arange(2), 1e4, 0), "rotary_dim"),
    "rotary rotary_dim negative": (lambda: mok.rotary(x_TF(2, 1, 8), torch.arange(2), 1e4, -2), "rotary_dim"),
    "rotary rotary_dim above head_dim": (lambda: mok.rotary(x_TF(2, 1, 8), torch.arange(2), 1e4, 10), "rotary_dim"),
    "rotary rotary_dim odd": (lambda: mok.rotary(x_TF(2, 1, 8), torch.arange(2), 1e4, 5), "rotary_dim"),
    "rotary rotary_dim float": (lambda: mok.rotary(x_TF(2, 1, 8), torch.arange(2), 1e4, 4.5), "rotary_dim"),
    "rotary rotary_dim bool": (lambda: mok.rotary(x_TF(2, 1, 8), torch.arange(2), 1e4, True), "rotary_dim"),
    "rotary positions float": (lambda: mok.rotary(x_TF(2, 1, 8), torch.arange(2.0), 1e4), "integer"),
    "rotary positions not a tensor": (lambda: mok.rotary(x_TF(2, 1, 8), [0, 1], 1e4), "positions must be a tensor"),
    "rotary positions device": (lambda: mok.rotary(x_TF(2, 1, 8), torch.arange(2, device="meta"), 1e4), "device"),
    "rotary x dtype": (lambda: mok.rotary(torch.ones(2, 1, 8, dtype=torch.int32), torch.arange(2), 1e4), "dtype"),
    "rotary neox_style string": (lambda: mok.rotary(x_TF(2, 1, 8), torch.arange(2), 1e4, neox_style="False"),
                                 "neox_style"),
    "rotary neox_style none": (lambda: mok.rotary(x_TF(2, 1, 8), torch.arange(2), 1e4, neox_style=None), "neox_style"),
    "rotary yarn theta one": (lambda: mok.rotary(x_TF(2, 1, 8), torch.arange(2), 1.0, yarn=YarnScaling(4.0, 4096)),
                              "theta"),
    "rotary name int": (lambda: mok.rotary(x_TF(2, 1, 8), torch.arange(2), 1e4, name=3), "name"),
    # linear
    "linear weight 1d": (lambda: mok.linear(x_TF(), torch.randn(8)), "does not match"),
    "linear weight 3d": (lambda: mok.linear(x_TF(), torch.randn(1, 4, 8)), "does not match"),
    "linear weight features": (lambda: mok.linear(x_TF(), torch.randn(4, 7)), "does not match"),
    "linear scalar x": (lambda: mok.linear(torch.tensor(1.0), torch.randn(4, 1)), "does not match"),
    "linear bias shape": (lambda: mok.linear(x_TF(), torch.randn(4, 8), torch.randn(5)), "bias"),
    "linear bias 2d": (lambda: mok.linear(x_TF(), torch.randn(4, 8), torch.randn(1, 4)), "bias"),
    "linear bias dtype": (lambda: mok.linear(x_TF(), torch.randn(4, 8), torch.ones(4, dtype=torch.int64)),
                          "bias dtype"),
    "linear bias not a tensor": (lambda: mok.linear(x_TF(), torch.randn(4, 8), 1.0), "bias must be a tensor"),
    "linear weight dtype": (lambda: mok.linear(x_TF(), torch.ones(4, 8, dtype=torch.int32)), "dtypes"),
    "linear x not a tensor": (lambda: mok.linear(np.ones((3, 8)), torch.randn(4, 8)), "x must be a tensor"),
    "linear device": (lambda: mok.linear(x_TF(), torch.randn(4, 8, device="meta")), "device"),
    "linear name int": (lambda: mok.linear(x_TF(), torch.randn(4, 8), name=3), "name"),
    "head_linear name int": (lambda: mok.head_linear(x_TF(3, 2, 8), torch.randn(2, 4, 8), name=b"q"), "name"),
    "rms_norm name int": (lambda: mok.rms_norm(x_TF(), torch.ones(8), 1e-6, name=1), "name"),
    "silu_and_mul name int": (lambda: mok.silu_and_mul(x_TF(), name=1.0), "name"),
    "logprobs name int": (lambda: mok.logprobs(x_TF(), torch.zeros(3, dtype=torch.int64), name=1), "name"),
    "route name int": (lambda: mok.route(torch.randn(3, 8), 2, name=1), "name"),
    # attention / paged attention / write_kv_cache (more in tests/mok/test_attention.py)
    "attention no key heads": (lambda: mok.attention(x_TF(2, 2, 8), x_TF(2, 0, 8), x_TF(2, 0, 8), torch.tensor([0, 2]),
                                                     torch.tensor([0, 2]), 0.3), "key/value heads"),
    "attention cu_seqlens device": (lambda: mok.attention(x_TF(3, 2, 16), x_TF(3, 1, 16), x_TF(3, 1, 16),
                                                          torch.tensor([0, 3], device="meta"),
                                                          torch.tensor([0, 3], device="meta"), 0.25), "device"),
    "attention name int": (lambda: mok.attention(x_TF(3, 2, 16), x_TF(3, 1, 16), x_TF(3, 1, 16), torch.tensor([0, 3]),
                                                 torch.tensor([0, 3]), 0.25, name=1), "name"),
    "paged attention no key heads": (lambda: mok.paged_attention(
        x_TF(2, 2, 8), torch.zeros(1, 4, 0, 8), torch.zeros(1, 4, 0, 8), torch.tensor([0, 2], dtype=torch.int32),
        torch.tensor([2], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32), 0.3), "G > 0"),
    "write_kv_cache k scalar": (lambda: mok.write_kv_cache(torch.tensor(1.0), x_TF(3, 2, 8), torch.zeros(2, 4, 2, 16),
                                                           torch.zeros(2, 4, 2, 8), torch.tensor([0, 1, 2])),
                                "[T, G, D]"),
    "write_kv_cache names itself": (lambda: mok.write_kv_cache(x_TF(3, 2, 8), x_TF(3, 2, 8), torch.zeros(2, 4, 2, 16),
                                                               torch.zeros(2, 4, 2, 8), torch.tensor([0, 1, 2])),
                                    "write_kv_cache: the caches' last dim"),
    "write_kv_cache k dtype": (lambda: mok.write_kv_cache(torch.ones(3, 2, 16, dtype=torch.int64), x_TF(3, 2, 8),
                                                          torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 8),
                                                          torch.tensor([0, 1, 2])), "dtypes"),
    "write_kv_cache slot device": (lambda: mok.write_kv_cache(x_TF(3, 2, 16), x_TF(3, 2, 8), torch.zeros(2, 4, 2, 16),
                                                              torch.zeros(2, 4, 2, 8),
                                                              torch.tensor([0, 1, 2], device="meta")), "device"),
    # logprobs / log_softmax
    "logprobs ids float": (lambda: mok.logprobs(x_TF(), torch.zeros(3)), "token_ids"),
    "logprobs ids bool": (lambda: mok.logprobs(x_TF(), torch.zeros(3, dtype=torch.bool)), "token_ids"),
    "logprobs ids complex": (lambda: mok.logprobs(x_TF(), torch.zeros(3, dtype=torch.complex64)), "token_ids"),
    "logprobs ids shape": (lambda: mok.logprobs(x_TF(), torch.zeros(3, 1, dtype=torch.int64)), "token_ids"),
    "logprobs ids not a tensor": (lambda: mok.logprobs(x_TF(), [0, 1, 2]), "token_ids must be a tensor"),
    "logprobs ids range": (lambda: mok.logprobs(x_TF(), torch.tensor([0, 1, 8])), "token ids"),
    "logprobs ids negative": (lambda: mok.logprobs(x_TF(), torch.tensor([0, -1, 2])), "token ids"),
    "logprobs ids device": (lambda: mok.logprobs(x_TF(), torch.zeros(3, dtype=torch.int64, device="meta")), "device"),
    "logprobs logits dtype": (lambda: mok.logprobs(torch.ones(3, 8, dtype=torch.int32), torch.zeros(3).long()),
                              "dtype"),
    "log_softmax 1d": (lambda: mok.log_softmax(torch.randn(8)), "[T, V]"),
    "log_softmax empty vocab": (lambda: mok.log_softmax(torch.randn(3, 0)), "[T, V]"),
    "log_softmax not a tensor": (lambda: mok.log_softmax([[1.0]]), "logits must be a tensor"),
    "log_softmax fp64": (lambda: mok.log_softmax(torch.randn(3, 8).double()), "dtype"),
    "log_softmax device": (lambda: mok.log_softmax(torch.randn(3, 8, device="meta")), "cpu or cuda"),
    # silu_and_mul
    "silu_and_mul odd": (lambda: mok.silu_and_mul(torch.randn(3, 7)), "even"),
    "silu_and_mul dtype": (lambda: mok.silu_and_mul(torch.ones(3, 8, dtype=torch.int32)), "dtype"),
    "silu_and_mul not a tensor": (lambda: mok.silu_and_mul([1.0, 2.0]), "x must be a tensor"),
    "silu_and_mul device": (lambda: mok.silu_and_mul(torch.randn(3, 8, device="meta")), "cpu or cuda"),
    # route / moe
    "route top_k bool": (lambda: mok.route(torch.randn(3, 8), True), "top_k"),
    "route top_k float": (lambda: mok.route(torch.randn(3, 8), 2.0), "top_k"),
    "route top_k zero": (lambda: mok.route(torch.randn(3, 8), 0), "top_k"),
    "route top_k above E": (lambda: mok.route(torch.randn(3, 8), 9), "top_k"),
    "route logits not a tensor": (lambda: mok.route([[0.0, 1.0]], 1), "router_logits"),
    "replay ids out of range (cpu)": (lambda: replay_weights(torch.randn(3, 8), torch.full((3, 2), -1)), "topk_ids"),
    "moe top_k bool": (lambda: mok.moe(torch.randn(3, 8), torch.randn(3, 4), torch.randn(4, 6, 8),
                                       torch.randn(4, 8, 3), True), "top_k"),
    "moe top_k float": (lambda: mok.moe(torch.randn(3, 8), torch.randn(3, 4), torch.randn(4, 6, 8),
                                        torch.randn(4, 8, 3), 1.0), "top_k"),
    "MoE top_k float": (lambda: mok.MoE(8, 4, 4, 2.0), "top_k"),
    "MoE top_k bool": (lambda: mok.MoE(8, 4, 4, True), "top_k"),
    "MoE hidden zero": (lambda: mok.MoE(0, 4, 4, 2), "hidden_size"),
    "MoE experts float": (lambda: mok.MoE(8, 4, 4.0, 2), "num_experts"),
    "MoE forward not a tensor": (lambda: mok.MoE(16, 8, 4, 2)([[0.0] * 16]), "must be a tensor"),
    "MoE forward scalar": (lambda: mok.MoE(16, 8, 4, 2)(torch.tensor(1.0)), "expects"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_parameter_raises_unsupported_error(case):
    call, fragment = BAD[case]
    with pytest.raises(mok.UnsupportedError, match=None) as info:
        call()
    assert fragment in str(info.value), (case, str(info.value))
    assert isinstance(info.value, mok.MokError) and isinstance(info.value, ValueError)


GOOD = {
    "rms_norm eps zero": lambda: mok.rms_norm(x_TF(), torch.ones(8), 0.0),
    "rms_norm eps int": lambda: mok.rms_norm(x_TF(), torch.ones(8), 0),
    "rms_norm eps numpy": lambda: mok.rms_norm(x_TF(), torch.ones(8), np.float32(1e-6)),
    "rotary theta int": lambda: mok.rotary(x_TF(2, 1, 8), torch.arange(2), 10000),
    "rotary theta numpy": lambda: mok.rotary(x_TF(2, 1, 8), torch.arange(2), np.float64(1e4)),
    "rotary rotary_dim numpy int": lambda: mok.rotary(x_TF(2, 1, 8), torch.arange(2), 1e4, np.int64(4)),
    "logprobs ids int32": lambda: mok.logprobs(x_TF(), torch.zeros(3, dtype=torch.int32)),
    "logprobs ids uint8": lambda: mok.logprobs(x_TF(), torch.zeros(3, dtype=torch.uint8)),
    "linear bf16 bias on fp32": lambda: mok.linear(x_TF(), torch.randn(4, 8), torch.randn(4).bfloat16()),
    "route top_k numpy int": lambda: mok.route(torch.randn(3, 8), 2),
}


@pytest.mark.parametrize("case", sorted(GOOD))
def test_valid_parameters_are_accepted(case):
    GOOD[case]()


def test_rms_norm_int_eps_gives_the_float_eps_bits():
    x, w = x_TF(), torch.randn(8)
    assert torch.equal(mok.rms_norm(x, w, 1), mok.rms_norm(x, w, 1.0))


EMPTY = {  # no tokens, or rows of no features, in the shapes the ops document: the same shape back
    "rotary [0, D]": (lambda: mok.rotary(x_TF(0, 64), torch.zeros(0, dtype=torch.long), 1e4), (0, 64)),
    "rotary [0, 2, 2, D]": (lambda: mok.rotary(x_TF(0, 2, 2, 16), torch.zeros(0, dtype=torch.long), 1e4),
                            (0, 2, 2, 16)),
    "silu_and_mul [2, 3, 0]": (lambda: mok.silu_and_mul(x_TF(2, 3, 0)), (2, 3, 0)),
    "linear [2, 3, 0] x [4, 0]": (lambda: mok.linear(x_TF(2, 3, 0), torch.randn(4, 0)), (2, 3, 4)),
    "head_linear [2, 3, 4, 0] x [4, 5, 0]": (lambda: mok.head_linear(x_TF(2, 3, 4, 0), torch.randn(4, 5, 0)),
                                             (2, 3, 4, 5)),
}


@pytest.mark.parametrize("case", sorted(EMPTY))
def test_empty_inputs_give_empty_outputs(case):
    call, shape = EMPTY[case]
    out = call()
    assert tuple(out.shape) == shape
    assert not out.any()  # a sum over no features is 0 (linear), and no element is anything else
