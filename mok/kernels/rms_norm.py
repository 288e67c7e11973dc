"""Triton RMSNorm (optionally fused with the residual add) behind mok.rms_norm, and the element-wise
parts of its backward.

Shapes: docs/shapes.md. One program per row holds the whole row (BLOCK_F = next power of two of F),
so the sum of squares is one tl.sum whose order depends on F only: batch-invariant. Semantics in
mok/reference/rms_norm.py (fp32 math, weight multiply in fp32, one rounding).

Backward (rms_norm_backward): the formula of mok/reference/rms_norm.py's rms_norm_backward with its
three sums taken by torch (as the CUDA path always did): two element-wise kernels write the sums'
fp32 operands and the rounded gradients, so the bf16 -> fp32 copies, broadcast products, the residual
gradient's add and the casts back are not separate torch passes. Same bits as the torch expression:
each multiply, subtract and add is one IEEE operation rounded to fp32 in the same order
(enable_fp_fusion=False: no fused multiply-add), the sums read the same fp32 tensors, and the final
fp32 -> bf16/fp16 conversion rounds to nearest even, as torch's `.to` does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, y_ptr, new_residual_ptr,
    F, stride_x, stride_r, stride_y, stride_nr, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_F: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_F)
    mask = offs < F
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        h = (x + r).to(new_residual_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * stride_nr + offs, h, mask=mask)
        x = h.to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / F
    rstd = tl.div_rn(1.0, tl.sqrt_rn(mean_square + eps))
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (x * rstd) * w
    tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_backward_products_kernel(
    grad_ptr, x_ptr, weight_ptr, squares_ptr, grad_w_x_ptr,
    T, F, stride_gt, stride_gf, stride_xt, stride_xf, stride_st, stride_sf,
    BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr,
):
    """The operands of the backward's two row sums, fp32 [T, F], one rounding per multiply: squares = x * x
    (laid out like x, as torch's x.float() * x.float() is) and grad_w_x = (grad * weight) * x (contiguous)."""
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows < T)[:, None] & (cols < F)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xt + cols[None, :] * stride_xf, mask=mask, other=0.0).to(tl.float32)
    grad = tl.load(grad_ptr + rows[:, None] * stride_gt + cols[None, :] * stride_gf, mask=mask,
                   other=0.0).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=cols < F, other=0.0).to(tl.float32)
    tl.store(squares_ptr + rows[:, None] * stride_st + cols[None, :] * stride_sf, x * x, mask=mask)
    tl.store(grad_w_x_ptr + rows[:, None] * F + cols[None, :], (grad * w[None, :]) * x, mask=mask)


@triton.jit
def _rms_norm_backward_kernel(
    grad_ptr, x_ptr, weight_ptr, rstd_ptr, rstd3_ptr, dot_mean_ptr, grad_residual_ptr,
    grad_x_ptr, grad_x2_ptr, grad_weight_terms_ptr,
    T, F, stride_gt, stride_gf, stride_xt, stride_xf, stride_rt, stride_rf,
    HAS_GRAD_RESIDUAL: tl.constexpr, SECOND_DTYPE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr,
):
    """grad_x = (rstd * (grad * weight) - (x * rstd3) * dot_mean) [+ grad_residual] in fp32, rounded once to
    grad_x's dtype (and to grad_x2's with SECOND_DTYPE); grad_weight_terms = grad * (x * rstd) in fp32, the
    operand of the weight gradient's column sum. rstd, rstd3, dot_mean: fp32 [T], computed by the caller."""
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    row_ok = rows < T
    mask = row_ok[:, None] & (cols < F)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xt + cols[None, :] * stride_xf, mask=mask, other=0.0).to(tl.float32)
    grad = tl.load(grad_ptr + rows[:, None] * stride_gt + cols[None, :] * stride_gf, mask=mask,
                   other=0.0).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=cols < F, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)[:, None]
    rstd3 = tl.load(rstd3_ptr + rows, mask=row_ok, other=0.0)[:, None]
    dot_mean = tl.load(dot_mean_ptr + rows, mask=row_ok, other=0.0)[:, None]
    grad_x = rstd * (grad * w[None, :]) - (x * rstd3) * dot_mean
    if HAS_GRAD_RESIDUAL:
        grad_x = grad_x + tl.load(grad_residual_ptr + rows[:, None] * stride_rt + cols[None, :] * stride_rf,
                                  mask=mask, other=0.0).to(tl.float32)
    out = rows[:, None] * F + cols[None, :]
    tl.store(grad_x_ptr + out, grad_x.to(grad_x_ptr.dtype.element_ty), mask=mask)
    if SECOND_DTYPE:
        tl.store(grad_x2_ptr + out, grad_x.to(grad_x2_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_weight_terms_ptr + out, grad * (x * rstd), mask=mask)


def rms_norm_config(num_features: int) -> dict:
    """The one place the configuration is chosen: from F only."""
    block_f = triton.next_power_of_2(num_features)
    return dict(BLOCK_F=block_f, num_warps=4 if block_f <= 1024 else (8 if block_f <= 4096 else 16))


def rms_norm(
    x_TF: torch.Tensor, residual_TF: torch.Tensor | None, weight_F: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (y [T, F] in x's dtype, new_residual [T, F] or None). Rows may be strided; last dim contiguous."""
    x_TF = x_TF if x_TF.stride(-1) == 1 else x_TF.contiguous()
    weight_F = weight_F.contiguous()
    num_rows, num_features = x_TF.shape
    y_TF = torch.empty(num_rows, num_features, dtype=x_TF.dtype, device=x_TF.device)
    new_residual_TF = None
    if residual_TF is not None:
        residual_TF = residual_TF if residual_TF.stride(-1) == 1 else residual_TF.contiguous()
        new_residual_TF = torch.empty_like(y_TF)
    if num_rows:
        _rms_norm_kernel[(num_rows,)](
            x_TF, residual_TF if residual_TF is not None else x_TF, weight_F, y_TF,
            new_residual_TF if new_residual_TF is not None else y_TF,
            num_features, x_TF.stride(0), (residual_TF if residual_TF is not None else x_TF).stride(0), y_TF.stride(0),
            (new_residual_TF if new_residual_TF is not None else y_TF).stride(0), eps,
            HAS_RESIDUAL=residual_TF is not None, **rms_norm_config(num_features),
        )
    return y_TF, new_residual_TF


def rms_norm_backward_config(num_features: int) -> dict:
    """Tiles of the element-wise backward kernels (any tile gives the same bits): from F only."""
    block_f = min(triton.next_power_of_2(num_features), 1024)
    return dict(BLOCK_T=max(1, 4096 // block_f), BLOCK_F=block_f, num_warps=4)


def rms_norm_backward(
    grad_TF: torch.Tensor, x_TF: torch.Tensor, weight_F: torch.Tensor, eps: float,
    grad_residual_TF: torch.Tensor | None, residual_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CUDA backward of mok::rms_norm_backward (mok/ops/rms_norm.py) -> (d x [T, F] in x's dtype, d x in
    residual_dtype [T, F] (an empty [0, F] when residual_dtype is None), d weight [F] in weight's dtype); d x
    includes grad_residual when given. The bits of the torch expression it replaces:

        x = x.float(); rstd = 1.0 / torch.sqrt((x * x).sum(-1, keepdim=True) / F + eps)
        grad_w = grad.float() * weight.float(); dot = (grad_w * x).sum(-1, keepdim=True)
        grad_x = rstd * grad_w - x * (rstd * rstd * rstd) * (dot / F)  [+ grad_residual.float()]
        grad_weight = (grad.float() * (x * rstd)).sum(0)
        -> grad_x.to(x.dtype), grad_x.to(residual_dtype), grad_weight.to(weight.dtype)

    The sums and the [T, 1] steps are those torch ops on fp32 operands of the same values and layouts; the
    [T, F] element-wise steps run in the two kernels above without FMA contraction (each product rounded, as
    torch's separate kernels round it). Any strides.
    """
    weight_F = weight_F.contiguous()
    num_rows, num_features = x_TF.shape
    device = x_TF.device
    squares_TF = torch.empty_like(x_TF, dtype=torch.float32)  # the layout of x.float() * x.float()
    grad_w_x_TF = torch.empty(num_rows, num_features, dtype=torch.float32, device=device)
    cfg = rms_norm_backward_config(num_features)
    grid = (triton.cdiv(num_rows, cfg["BLOCK_T"]), triton.cdiv(num_features, cfg["BLOCK_F"]))
    if squares_TF.numel():
        _rms_norm_backward_products_kernel[grid](
            grad_TF, x_TF, weight_F, squares_TF, grad_w_x_TF, num_rows, num_features, *grad_TF.stride(),
            *x_TF.stride(), *squares_TF.stride(), enable_fp_fusion=False, **cfg)
    rstd_T1 = 1.0 / torch.sqrt(squares_TF.sum(-1, keepdim=True) / num_features + eps)
    dot_T1 = grad_w_x_TF.sum(-1, keepdim=True)
    rstd3_T1 = rstd_T1 * rstd_T1 * rstd_T1
    dot_mean_T1 = dot_T1 / num_features
    grad_x_TF = torch.empty(num_rows, num_features, dtype=x_TF.dtype, device=device)
    second = residual_dtype is not None
    grad_x2_TF = torch.empty(num_rows if second else 0, num_features, dtype=residual_dtype or x_TF.dtype,
                             device=device)
    del squares_TF
    grad_weight_terms_TF = grad_w_x_TF  # summed already: its memory holds the weight gradient's terms (contiguous)
    if grad_x_TF.numel():
        residual_TF = grad_residual_TF if grad_residual_TF is not None else grad_TF
        _rms_norm_backward_kernel[grid](
            grad_TF, x_TF, weight_F, rstd_T1, rstd3_T1, dot_mean_T1, residual_TF,
            grad_x_TF, grad_x2_TF if second else grad_x_TF, grad_weight_terms_TF,
            num_rows, num_features, *grad_TF.stride(), *x_TF.stride(), *residual_TF.stride(),
            HAS_GRAD_RESIDUAL=grad_residual_TF is not None, SECOND_DTYPE=second, enable_fp_fusion=False, **cfg)
    grad_weight_F = grad_weight_terms_TF.sum(0).to(weight_F.dtype)
    return grad_x_TF, grad_x2_TF, grad_weight_F
