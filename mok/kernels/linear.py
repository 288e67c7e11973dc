"""Triton matmul behind mok.linear (forward) and the deterministic matmuls of the backwards.

Legend: B batch of independent matmuls, M rows (tokens), N output columns, K reduction length.
Reads kernel -> launcher -> adapter. Batch invariance: each program owns a [BLOCK_M, BLOCK_N] tile
and runs ONE sequential, unsplit K loop with an fp32 accumulator; no split-K, no atomics. The tile
configuration is chosen from (N, K, dtype) only, never from M (the number of tokens). fp32 operands
use input_precision="ieee" (no TF32).
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
    """The one place tile configurations are chosen: from N, K and the operand dtype, never from M."""
    if dtype == torch.float32:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=2)
    if n <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3)


def _launch(a_BMK, b_BKN, bias_N, c_BMN) -> None:
    batch, m, k = a_BMK.shape
    n = b_BKN.shape[2]
    upcast = a_BMK.dtype != b_BKN.dtype or a_BMK.dtype == torch.float32
    config = matmul_config(n, k, torch.float32 if upcast else a_BMK.dtype)
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n), batch)
    _matmul_kernel[grid](
        a_BMK, b_BKN, bias_N if bias_N is not None else c_BMN, c_BMN,
        m, n, k,
        *a_BMK.stride(), *b_BKN.stride(), *c_BMN.stride(),
        HAS_BIAS=bias_N is not None, UPCAST=upcast, **config,
    )


def matmul(
    a_BMK: torch.Tensor, b_BKN: torch.Tensor, bias_N: torch.Tensor | None = None, *, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """a @ b (+ bias) with an fp32 accumulator and a sequential K loop. Any strides.

    a: [M, K] or [B, M, K]; b: [K, N] or [B, K, N]; bias: [N] or None. Returns [M, N] / [B, M, N] in
    out_dtype (default a's dtype).
    """
    squeeze = a_BMK.dim() == 2
    if squeeze:
        a_BMK, b_BKN = a_BMK[None], b_BKN[None]
    out = torch.empty(a_BMK.shape[0], a_BMK.shape[1], b_BKN.shape[2], dtype=out_dtype or a_BMK.dtype, device=a_BMK.device)
    if out.numel():
        if a_BMK.shape[2] == 0:
            out.zero_()
            if bias_N is not None:
                out += bias_N.to(out.dtype)
        else:
            _launch(a_BMK, b_BKN, bias_N, out)
    return out[0] if squeeze else out


def linear(x_TK: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias -> [T, N] in x's dtype (weight read in place through its strides)."""
    return matmul(x_TK, weight_NK.t(), bias_N, out_dtype=x_TK.dtype)
