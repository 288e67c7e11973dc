"""Triton RMSNorm (optionally fused with the residual add) behind mok.rms_norm, and its backward.

Shapes: docs/shapes.md. A program holds whole rows (BLOCK_F = next power of two of F): one row, or for short rows
(q/k norms over a head, F <= 256) ROWS rows as one [ROWS, BLOCK_F] tile, so that a q norm of 32 heads per token is
not a million one-warp programs. Each row's sum of squares is one tl.sum along the row whose order depends on the
tile, i.e. on F only (rms_norm_forward_config): batch-invariant. Semantics in mok/reference/rms_norm.py (fp32 math,
weight multiply in fp32, one rounding).

Backward (rms_norm_backward): the formula of mok/reference/rms_norm.py's rms_norm_backward in two launches,
fp32 math with every sum in a fixed order; each row's d x (with the residual gradient added in fp32 and one
rounding) comes from that row alone, and the weight gradient from per-program partial sums added in order.
No fp32 [T, F] intermediates: it reads x and the gradients once and writes the rounded gradients.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok.kernels import launch
from mok.kernels.launch import cached_launch
from mok.kernels.layout import last_dim_contiguous


@triton.jit
def _row_rstd(x, F, eps):
    """1 / sqrt(sum(x * x) / F + eps) of one whole row x (fp32 [BLOCK_F], zeros past F): one tl.sum, whose order
    depends on F and BLOCK_F only."""
    mean_square = tl.sum(x * x, axis=0) / F
    return tl.div_rn(1.0, tl.sqrt_rn(mean_square + eps))


@cached_launch
@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, y_ptr, new_residual_ptr,
    num_rows, F, stride_x, stride_r, stride_y, stride_nr, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_F: tl.constexpr, ROWS: tl.constexpr,
):
    if ROWS == 1:  # one row per program: the [BLOCK_F] layout long rows have always had (their bits)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_F)
        mask = offs < F
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
            h = (x + r).to(new_residual_ptr.dtype.element_ty)
            tl.store(new_residual_ptr + row * stride_nr + offs, h, mask=mask)
            x = h.to(tl.float32)
        rstd = _row_rstd(x, F, eps)
        w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = (x * rstd) * w
        tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    else:  # ROWS rows of one tile; a row past num_rows is masked and reads nothing
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        offs = tl.arange(0, BLOCK_F)
        mask = (rows < num_rows)[:, None] & (offs < F)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + rows[:, None] * stride_r + offs[None, :], mask=mask, other=0.0).to(tl.float32)
            h = (x + r).to(new_residual_ptr.dtype.element_ty)
            tl.store(new_residual_ptr + rows[:, None] * stride_nr + offs[None, :], h, mask=mask)
            x = h.to(tl.float32)
        mean_square = tl.sum(x * x, axis=1) / F
        rstd = tl.div_rn(1.0, tl.sqrt_rn(mean_square + eps))
        w = tl.load(weight_ptr + offs, mask=offs < F, other=0.0).to(tl.float32)
        y = (x * rstd[:, None]) * w[None, :]
        tl.store(y_ptr + rows[:, None] * stride_y + offs[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@cached_launch
@triton.jit
def _rms_norm_backward_kernel(
    grad_ptr, x_ptr, weight_ptr, grad_residual_ptr, grad_x_ptr, grad_x2_ptr, grad_weight_partial_ptr,
    T, F, rows_per_program, eps, stride_gt, stride_gf, stride_xt, stride_xf, stride_rt, stride_rf,
    HAS_GRAD_RESIDUAL: tl.constexpr, SECOND_DTYPE: tl.constexpr, BLOCK_F: tl.constexpr,
):
    """Rows [pid * rows_per_program, ...) (those below T) one after another, each whole: rstd as in the forward, then
    grad_x = rstd * (grad * w) - (x * rstd^3) * (sum(grad * w * x) / F) [+ grad_residual] in fp32, rounded once
    to grad_x's dtype (and to grad_x2's with SECOND_DTYPE); the program's rows' grad * (x * rstd) summed in
    row order into grad_weight_partial[pid] (fp32 [F])."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK_F)
    col_ok = offs < F
    w = tl.load(weight_ptr + offs, mask=col_ok, other=0.0).to(tl.float32)
    grad_weight = tl.zeros([BLOCK_F], dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_program
    for row in range(first, tl.minimum(first + rows_per_program, T)):
        x = tl.load(x_ptr + row * stride_xt + offs * stride_xf, mask=col_ok, other=0.0).to(tl.float32)
        grad = tl.load(grad_ptr + row * stride_gt + offs * stride_gf, mask=col_ok, other=0.0).to(tl.float32)
        rstd = _row_rstd(x, F, eps)
        grad_w = grad * w
        dot = tl.sum(grad_w * x, axis=0)
        grad_x = rstd * grad_w - (x * (rstd * rstd * rstd)) * (dot / F)
        if HAS_GRAD_RESIDUAL:
            grad_x = grad_x + tl.load(grad_residual_ptr + row * stride_rt + offs * stride_rf, mask=col_ok,
                                      other=0.0).to(tl.float32)
        tl.store(grad_x_ptr + row * F + offs, grad_x.to(grad_x_ptr.dtype.element_ty), mask=col_ok)
        if SECOND_DTYPE:
            tl.store(grad_x2_ptr + row * F + offs, grad_x.to(grad_x2_ptr.dtype.element_ty), mask=col_ok)
        grad_weight += grad * (x * rstd)
    tl.store(grad_weight_partial_ptr + pid * F + offs, grad_weight, mask=col_ok)


@cached_launch
@triton.jit
def _column_sum_kernel(partial_ptr, out_ptr, P, F, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """out[c] = the sum over p of partial[p, c] (fp32 [P, F]), BLOCK_P rows at a time (a fixed tree), in order,
    rounded once to out's dtype."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < F
    total = tl.zeros([BLOCK_C], dtype=tl.float32)
    for first in range(0, P, BLOCK_P):
        rows = first + tl.arange(0, BLOCK_P)
        tile = tl.load(partial_ptr + rows[:, None] * F + cols[None, :], mask=(rows < P)[:, None] & col_ok[None, :],
                       other=0.0)
        total += tl.sum(tile, axis=0)
    tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=col_ok)


# Rows of up to this many features share a program, as a tile of this many elements.
SHORT_ROW_FEATURES = 256
SHORT_ROW_TILE = 4096


def rms_norm_config(num_features: int) -> dict:
    """The one place the configuration is chosen: from F only (the backward takes BLOCK_F and num_warps)."""
    block_f = triton.next_power_of_2(num_features)
    return dict(BLOCK_F=block_f, num_warps=4 if block_f <= 1024 else (8 if block_f <= 4096 else 16))


def rms_norm_forward_config(num_features: int) -> dict:
    """rms_norm_config and the forward's rows per program (ROWS), from F only."""
    config = rms_norm_config(num_features)
    rows = SHORT_ROW_TILE // config["BLOCK_F"] if config["BLOCK_F"] <= SHORT_ROW_FEATURES else 1
    return dict(config, ROWS=rows)


def forward_site(per_call: tuple, scalars: tuple) -> None:
    """The forward's launch: per_call (x, weight, y) or (x, residual, weight, y, new_residual) as rms_norm makes
    them ([T, F] with T > 0, rows of x and residual possibly strided; y and new_residual contiguous), scalars (eps,).
    The site the native eager path replays (mok/kernels/native/native.cpp keeps the same order)."""
    if len(per_call) == 3:
        x_TF, weight_F, y_TF = per_call
        residual_TF = new_residual_TF = None
    else:
        x_TF, residual_TF, weight_F, y_TF, new_residual_TF = per_call
    eps, = scalars
    num_rows, num_features = x_TF.shape
    residual_or_x_TF = x_TF if residual_TF is None else residual_TF
    new_residual_or_y_TF = y_TF if new_residual_TF is None else new_residual_TF
    config = rms_norm_forward_config(num_features)
    _rms_norm_kernel[(triton.cdiv(num_rows, config["ROWS"]),)](
        x_TF, residual_or_x_TF, weight_F, y_TF, new_residual_or_y_TF,
        num_rows, num_features, x_TF.stride(0), residual_or_x_TF.stride(0), y_TF.stride(0),
        new_residual_or_y_TF.stride(0), eps, HAS_RESIDUAL=residual_TF is not None, **config)


# Launch plans of the CUDA launchers below (mok/kernels/launch.py): at most this many keys (0: none). Why: host work
# is most of an eager call at training sizes (the forward's launcher alone costs twice torch's whole F.rms_norm).
plans = launch.PlanCache(32)


def rms_norm(
    x_TF: torch.Tensor, residual_TF: torch.Tensor | None, weight_F: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (y [T, F] in x's dtype, new_residual [T, F] or None). Rows may be strided; last dim contiguous."""
    x_TF = last_dim_contiguous(x_TF)
    weight_F = weight_F.contiguous()
    num_rows, num_features = x_TF.shape
    y_TF = torch.empty(num_rows, num_features, dtype=x_TF.dtype, device=x_TF.device)
    if residual_TF is None:
        new_residual_TF = None
        per_call = (x_TF, weight_F, y_TF)
    else:
        residual_TF = last_dim_contiguous(residual_TF)
        new_residual_TF = torch.empty_like(y_TF)
        per_call = (x_TF, residual_TF, weight_F, y_TF, new_residual_TF)
    if num_rows:
        launch.launch_planned(plans, ("rms_norm", eps), per_call, lambda: forward_site(per_call, (eps,)))
    return y_TF, new_residual_TF


# Rows per program of the backward: enough programs to fill the GPU, at most this many partial weight-gradient rows.
BACKWARD_MAX_PROGRAMS = 1024
COLUMN_SUM = dict(BLOCK_P=32, BLOCK_C=64, num_warps=4)


def rms_norm_backward(
    grad_TF: torch.Tensor, x_TF: torch.Tensor, weight_F: torch.Tensor, eps: float,
    grad_residual_TF: torch.Tensor | None, residual_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CUDA backward of mok::rms_norm_backward (mok/ops/rms_norm.py) -> (d x [T, F] in x's dtype, d x in
    residual_dtype [T, F] (an empty [0, F] when residual_dtype is None), d weight [F] in weight's dtype); d x
    includes grad_residual when given, one rounding of the same fp32 value per dtype. Any strides (a last dim
    of stride other than 1 is copied first).

    Two launches: _rms_norm_backward_kernel (each row's d x from that row alone: the same bits whatever the other
    rows; per program a partial weight gradient over its rows in order) and _column_sum_kernel (the partials in
    order). Deterministic: the order of every sum depends on T and F only (docs/contracts.md, Bitwise: backward
    passes need run-to-run determinism, not batch invariance).
    """
    grad_TF, x_TF, grad_residual_TF = map(last_dim_contiguous, (grad_TF, x_TF, grad_residual_TF))
    weight_F = weight_F.contiguous()
    num_rows, num_features = x_TF.shape
    device = x_TF.device
    second = residual_dtype is not None
    grad_x_TF = torch.empty(num_rows, num_features, dtype=x_TF.dtype, device=device)
    grad_x2_TF = torch.empty(num_rows if second else 0, num_features, dtype=residual_dtype or x_TF.dtype,
                             device=device)
    rows_per_program = max(1, triton.cdiv(num_rows, BACKWARD_MAX_PROGRAMS))
    programs = triton.cdiv(num_rows, rows_per_program)
    partial_PF = torch.empty(programs, num_features, dtype=torch.float32, device=device)
    grad_weight_F = torch.empty_like(weight_F)
    if programs and num_features:
        per_call = (grad_TF, x_TF, weight_F, grad_x_TF, partial_PF, grad_weight_F,
                    *(() if grad_residual_TF is None else (grad_residual_TF,)), *((grad_x2_TF,) if second else ()))
        scalars = (eps, float(grad_residual_TF is not None), float(second), float(rows_per_program))
        launch.launch_planned(plans, ("rms_norm_backward", *scalars, *COLUMN_SUM.values()), per_call,
                              lambda: backward_site(per_call, scalars))
    else:
        grad_weight_F.zero_()
    return grad_x_TF, grad_x2_TF, grad_weight_F


def backward_site(per_call: tuple, scalars: tuple) -> None:
    """The backward's two launches: per_call (grad, x, weight, grad_x, partial, grad_weight[, grad_residual][,
    grad_x2]) as rms_norm_backward makes them (partial: fp32 [programs, F]), scalars (eps, 1.0 with a
    grad_residual, 1.0 with a grad_x2, rows per program). The site the native eager path replays (native.cpp keeps
    the same order)."""
    eps, has_grad_residual, second, rows_per_program = scalars
    grad_TF, x_TF, weight_F, grad_x_TF, partial_PF, grad_weight_F = per_call[:6]
    grad_residual_TF = per_call[6] if has_grad_residual else None
    grad_x2_TF = per_call[-1] if second else grad_x_TF
    num_rows, num_features = x_TF.shape
    programs = partial_PF.shape[0]
    residual_TF = grad_TF if grad_residual_TF is None else grad_residual_TF
    _rms_norm_backward_kernel[(programs,)](
        grad_TF, x_TF, weight_F, residual_TF, grad_x_TF, grad_x2_TF, partial_PF,
        num_rows, num_features, int(rows_per_program), eps, *grad_TF.stride(), *x_TF.stride(),
        *residual_TF.stride(), HAS_GRAD_RESIDUAL=grad_residual_TF is not None, SECOND_DTYPE=bool(second),
        **rms_norm_config(num_features))
    _column_sum_kernel[(triton.cdiv(num_features, COLUMN_SUM["BLOCK_C"]),)](
        partial_PF, grad_weight_F, programs, num_features, **COLUMN_SUM)
