"""Triton matmul behind mok.linear (forward) and the deterministic matmuls of the backwards.

Shapes: docs/shapes.md (here a matmul's rows are T, its reduction F and its output columns O, as in a
linear; B is a batch of independent products; inside the kernel M, N, K are the GEMM's rows, output
columns and reduction, as in BLOCK_M/N/K). Reads kernel -> launcher -> adapter. Batch invariance
(docs/kernels.md): each program owns a [BLOCK_M, BLOCK_N] tile and runs ONE sequential, unsplit K loop
with an fp32 accumulator; no split-K, no atomics. The tile configuration is chosen from (O, F, dtype)
only, never from T (the number of tokens). fp32 operands use input_precision="ieee" (no TF32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, bias_ptr, c_ptr,
    M, N, K,
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bk, stride_bn,
    stride_cb, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped tile order for L2 reuse; it changes which program computes a tile, not the tile's math.
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    a_ptrs = a_ptr + batch * stride_ab + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + batch * stride_bb + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & (offs_n[None, :] < N), other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision="ieee")
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + batch * stride_cb + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def matmul_config(n: int, k: int, dtype: torch.dtype) -> dict:
    """The one place tile configurations are chosen: from N (output columns), K (reduction) and the
    operand dtype, never from M (rows: the tokens)."""
    if dtype == torch.float32:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=2)
    if n <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3)


def _launch(a_BTF, b_BFO, bias_O, out_BTO) -> None:
    batch, rows, reduction = a_BTF.shape
    cols = b_BFO.shape[2]
    upcast = a_BTF.dtype != b_BFO.dtype or a_BTF.dtype == torch.float32
    config = matmul_config(cols, reduction, torch.float32 if upcast else a_BTF.dtype)
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    grid = (triton.cdiv(rows, block_m) * triton.cdiv(cols, block_n), batch)
    _matmul_kernel[grid](
        a_BTF, b_BFO, bias_O if bias_O is not None else out_BTO, out_BTO,
        rows, cols, reduction,
        *a_BTF.stride(), *b_BFO.stride(), *out_BTO.stride(),
        HAS_BIAS=bias_O is not None, UPCAST=upcast, **config,
    )


def matmul(a_BTF: torch.Tensor, b_BFO: torch.Tensor, bias_O: torch.Tensor | None = None, *,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """a @ b (+ bias) with an fp32 accumulator and a sequential F loop. Any strides.

    a: [T, F] or [B, T, F]; b: [F, O] or [B, F, O]; bias: [O] or None. Returns [T, O] / [B, T, O] in
    out_dtype (default a's dtype).
    """
    squeeze = a_BTF.dim() == 2
    if squeeze:
        a_BTF, b_BFO = a_BTF[None], b_BFO[None]
    out_BTO = torch.empty(a_BTF.shape[0], a_BTF.shape[1], b_BFO.shape[2], dtype=out_dtype or a_BTF.dtype,
                          device=a_BTF.device)
    if out_BTO.numel():
        if a_BTF.shape[2] == 0:
            out_BTO.zero_()
            if bias_O is not None:
                out_BTO += bias_O.to(out_BTO.dtype)
        else:
            _launch(a_BTF, b_BFO, bias_O, out_BTO)
    return out_BTO[0] if squeeze else out_BTO


def bmm_nt(a_BTF: torch.Tensor, b_BOF: torch.Tensor) -> torch.Tensor:
    """Batched a @ b.T: [B, T, F] x [B, O, F] -> fp32 [B, T, O], sequential F loop, any strides
    (the CUDA counterpart of mok.reference.linear.bmm_nt)."""
    return matmul(a_BTF, b_BOF.transpose(-1, -2), out_dtype=torch.float32)


def linear(x_TF: torch.Tensor, w_OF: torch.Tensor, bias_O: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T + bias -> [T, O] in x's dtype (w read in place through its strides)."""
    return matmul(x_TF, w_OF.t(), bias_O, out_dtype=x_TF.dtype)
