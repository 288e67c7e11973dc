"""mok.rotary: batch-invariant rotary position embedding (neox or GPT-J style, partial rotary dim).

Shapes: docs/shapes.md (x_TQD: Q heads, query or key/value heads alike, dims between T and D
flattened; R the rotary dim).
Semantics in mok/reference/rotary.py: inv_freq computed once on the host in fp64 and rounded to fp32,
angle = fp32(position) * inv_freq, cos/sin in fp32, rotation in fp32, one rounding.
The backward is the same op rotating by -angle: deterministic, element-wise.
The op's default implementation is the CPU reference; the CUDA kernel is registered with
register_kernel("cuda") (mok/kernels/rotary.py). On CUDA the kernel reads cos/sin from a cached fp32
table built once per (theta, rotary_dim, device) by the same formula (same bits); `max_positions` only
sizes that table (positions beyond it are computed per token, with the same bits).
"""
from __future__ import annotations

import math

import torch

from mok import hooks
from mok.errors import UnsupportedError
from mok.ops import dispatch
from mok.ops.checks import FLOAT_DTYPES, check_bool, check_device, check_int, check_name, check_real, check_tensor
from mok.reference import rotary as reference
from mok.reference.rotary import YarnScaling

__all__ = ["YarnScaling", "rotary"]


def _check_yarn(yarn: YarnScaling | None, theta: float) -> list[float] | None:
    """The custom op's form of `yarn` (a list of 5 floats, or None), its values checked (YaRN's ramp divides by
    log(theta): theta 1 has none)."""
    if yarn is None:
        return None
    if not isinstance(yarn, YarnScaling):
        raise UnsupportedError(f"rotary: yarn must be a mok.ops.rotary.YarnScaling or None, got {type(yarn).__name__}")
    factor = check_real(yarn.factor, "rotary: yarn factor", positive=True)
    if theta == 1.0:
        raise UnsupportedError("rotary: yarn needs theta != 1 (its frequency ramp divides by log(theta))")
    original = check_int(yarn.original_max_position_embeddings, "rotary: yarn original_max_position_embeddings")
    if original <= 0:
        raise UnsupportedError(f"rotary: yarn original_max_position_embeddings must be > 0, got {original}")
    values = [factor, float(original), check_real(yarn.beta_fast, "rotary: yarn beta_fast", positive=True),
              check_real(yarn.beta_slow, "rotary: yarn beta_slow", positive=True),
              check_real(yarn.attention_factor, "rotary: yarn attention_factor", positive=True)]
    return values


@torch.library.custom_op("mok::rotary", mutates_args=())
def _rotary_op(
    x_TQD: torch.Tensor, positions_T: torch.Tensor, theta: float, rotary_dim: int, neox_style: bool, inverse: bool,
    max_positions: int = 0, yarn: list[float] | None = None,
) -> torch.Tensor:
    check_device(x_TQD, positions_T)
    return reference.rotary(x_TQD, positions_T, theta, rotary_dim, neox_style, inverse,
                            reference.yarn_from_list(yarn))


def _rotary_cuda(x_TQD, positions_T, theta, rotary_dim, neox_style, inverse, max_positions=0, yarn=None):
    check_device(x_TQD, positions_T)
    from mok.kernels import rotary as kernels

    return kernels.rotary(x_TQD, positions_T, theta, rotary_dim, neox_style, inverse, max_positions,
                          yarn=reference.yarn_from_list(yarn))


@_rotary_op.register_fake
def _(x_TQD, positions_T, theta, rotary_dim, neox_style, inverse, max_positions=0, yarn=None):
    return torch.empty_like(x_TQD)


def _setup_context(ctx, inputs, output):
    _, positions_T, theta, rotary_dim, neox_style, inverse, max_positions, yarn = inputs
    ctx.save_for_backward(positions_T)
    ctx.args = (theta, rotary_dim, neox_style, not inverse, max_positions, yarn)


def _backward(ctx, grad_TQD):
    (positions_T,) = ctx.saved_tensors
    return _rotary(grad_TQD.contiguous(), positions_T, *ctx.args), None, None, None, None, None, None, None


_rotary = dispatch.register(_rotary_op, cuda=_rotary_cuda, backward=_backward, setup_context=_setup_context)


def rotary(
    x_TQD: torch.Tensor,
    positions_T: torch.Tensor,
    theta: float,
    rotary_dim: int | None = None,
    neox_style: bool = True,
    *,
    name: str | None = None,
    max_positions: int | None = None,
    yarn: YarnScaling | None = None,
) -> torch.Tensor:
    """Rotate the first `rotary_dim` features of each head by position * inv_freq.

    x_TQD: [T, Q, D] (or [T, G, D] for keys, or [T, ..., D]) float; positions_T: [T] integer (absolute
    token positions); theta: rope base; rotary_dim: even, <= D (default D); neox_style: halves (True) or
    interleaved pairs (False).
    Returns the same shape and dtype. Differentiable w.r.t. x.
    `name`: when set and observed, emits (name, x, "input") and (name, out, "output").
    `max_positions`: optional bound the caller knows on the positions (e.g. the model's
    max_position_embeddings); on CUDA it sizes the cached cos/sin table so that every position below it
    reads the table (mok/kernels/rotary.py). Never changes the result: a position at or beyond it is
    still rotated correctly, with the same bits.
    `yarn`: YaRN scaling (mok.ops.rotary.YarnScaling: factor, original_max_position_embeddings, beta_fast,
    beta_slow, attention_factor), as DeepSeek-V3 checkpoints use it; formula in mok/reference/rotary.py.
    """
    check_name(name, "rotary")
    check_tensor(x_TQD, "rotary: x")
    check_tensor(positions_T, "rotary: positions")
    if x_TQD.dtype not in FLOAT_DTYPES:
        raise UnsupportedError(f"rotary: dtype {x_TQD.dtype} not in {FLOAT_DTYPES}")
    if x_TQD.dim() < 2 or positions_T.dim() != 1 or positions_T.shape[0] != x_TQD.shape[0]:
        raise UnsupportedError(
            f"rotary: x {tuple(x_TQD.shape)} must be [T, ..., D] with positions [T], got {tuple(positions_T.shape)}")
    if positions_T.dtype.is_floating_point or positions_T.dtype == torch.bool:
        raise UnsupportedError(f"rotary: positions must be an integer tensor, got {positions_T.dtype}")
    check_device(x_TQD, positions_T)
    head_dim = x_TQD.shape[-1]
    rotary_dim = head_dim if rotary_dim is None else check_int(rotary_dim, "rotary: rotary_dim")
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise UnsupportedError(f"rotary: rotary_dim {rotary_dim} must be even and in (0, {head_dim}]")
    theta = check_real(theta, "rotary: theta", positive=True)
    max_positions = 0 if max_positions is None else check_int(max_positions, "rotary: max_positions")
    if max_positions < 0:
        raise UnsupportedError(f"rotary: max_positions must be >= 0, got {max_positions}")
    neox_style = check_bool(neox_style, "rotary: neox_style")
    yarn_args = _check_yarn(yarn, theta)
    observed = name is not None and hooks.observed()
    if observed:
        hooks.emit(name, x_TQD, "input")
    shape = x_TQD.shape
    # the heads' count spelled out: reshape cannot infer a -1 when T = 0
    x_flat_TQD = x_TQD if x_TQD.dim() == 3 else x_TQD.reshape(shape[0], math.prod(shape[1:-1]), head_dim)
    out = dispatch.shaped(_rotary(x_flat_TQD, positions_T.long(), theta, rotary_dim, neox_style, False,
                                  max_positions, yarn_args), shape)
    if observed:
        hooks.emit(name, out, "output")
    return out
