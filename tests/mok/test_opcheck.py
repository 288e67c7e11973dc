"""torch.library.opcheck on every dense custom op: schema, fake (meta) impls, autograd registration,
and AOT dispatch, so the ops trace under torch.compile (vLLM compiles models)."""

import pytest
import torch

from mok.ops import attention, linear, logprobs, rms_norm, rotary, silu_and_mul


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _value(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


def _leaf(*shape):
    return _value(*shape).requires_grad_()


CASES = {
    "linear": lambda: (linear._linear_op, (_leaf(5, 8), _leaf(6, 8), _leaf(6))),
    "linear_no_bias": lambda: (linear._linear_op, (_leaf(5, 8), _leaf(6, 8), None)),
    # a weight viewed through strides, as rl/models/mla.py reads kv_b_proj's
    "head_linear": lambda: (linear._head_linear_op, (_leaf(5, 3, 8), _value(3, 8, 6).transpose(1, 2).requires_grad_())),
    "rms_norm": lambda: (rms_norm._rms_norm_op, (_leaf(5, 8), _leaf(8), 1e-6)),
    "fused_add_rms_norm": lambda: (rms_norm._fused_add_rms_norm_op, (_leaf(5, 8), _leaf(5, 8), _leaf(8), 1e-6)),
    # a column-major x: every implementation and fake gives contiguous outputs
    "rms_norm_transposed": lambda: (rms_norm._rms_norm_op, (_value(8, 5).t().requires_grad_(), _leaf(8), 1e-6)),
    "fused_add_rms_norm_transposed": lambda: (
        rms_norm._fused_add_rms_norm_op, (_value(8, 5).t().requires_grad_(), _leaf(5, 8), _leaf(8), 1e-6)),
    "rotary": lambda: (rotary._rotary_op, (_leaf(5, 2, 8), torch.arange(5), 1e4, 8, True, False)),
    "silu_and_mul": lambda: (silu_and_mul._silu_and_mul_op, (_leaf(5, 8),)),
    "log_softmax": lambda: (logprobs._log_softmax_op, (_leaf(5, 8),)),
    "logprobs": lambda: (logprobs._logprobs_op, (_leaf(5, 8), torch.tensor([0, 1, 2, 3, 7]))),
    # the backward ops (no double backward: inputs without grad)
    "logprobs_backward": lambda: (logprobs._logprobs_backward_op,
                                  (_value(5), _value(5, 8), torch.tensor([0, 1, 2, 3, 7]))),
    "rms_norm_backward_residual_other_dtype": lambda: (
        rms_norm._rms_norm_backward_op, (_value(5, 8), _value(5, 8), _value(8), 1e-6, _value(5, 8), torch.float16)),
    "rms_norm_backward_plain": lambda: (
        rms_norm._rms_norm_backward_op, (_value(5, 8), _value(5, 8), _value(8), 1e-6, None, None)),
    "rms_norm_backward_transposed": lambda: (
        rms_norm._rms_norm_backward_op, (_value(8, 5).t(), _value(8, 5).t(), _value(8), 1e-6, None, None)),
    "silu_and_mul_backward_strided": lambda: (
        silu_and_mul._silu_and_mul_backward_op, (_value(6, 5).t(), _value(5, 24)[:, ::2])),
    "fused_add_rms_norm_mixed_dtypes": lambda: (
        rms_norm._fused_add_rms_norm_op, (_leaf(5, 8), _leaf(5, 8).detach().half().requires_grad_(), _leaf(8), 1e-6)),
    "attention": lambda: (
        attention._attention_op,
        (_leaf(4, 2, 8), _leaf(6, 1, 8), _leaf(6, 1, 8), _cu([1, 3]), _cu([3, 3]), 0.3, True),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_opcheck(case):
    op, args = CASES[case]()
    result = torch.library.opcheck(
        op,
        args,
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )
    assert all(v == "SUCCESS" for v in result.values()), result
