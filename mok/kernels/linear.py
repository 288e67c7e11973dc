"""Triton matmul behind mok.linear (forward) and the deterministic matmuls of the backwards.

Shapes: docs/shapes.md (here a matmul's rows are T, its reduction F and its output columns O, as in a
linear; B is a batch of independent products; inside the kernel M, N, K are the GEMM's rows, output
columns and reduction, as in BLOCK_M/N/K). Reads kernel -> launcher -> adapter. Batch invariance
(docs/kernels.md): each program owns a [BLOCK_M, BLOCK_N] tile and runs ONE sequential, unsplit K loop
with an fp32 accumulator; no split-K, no atomics. The tile configuration (CONFIGS) may follow T: a row's
bits do not depend on the tile (docs/kernels.md). fp32 operands use input_precision="ieee" (no TF32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok.kernels.launch import cached_launch

try:  # host-side TMA descriptors (Triton >= 3.4); without them every launch uses pointer loads
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

# How the kernel loads an operand (the A_LOAD / B_LOAD constexprs). A is [M, K], B is [K, N] in the math.
LOAD_POINTER = tl.constexpr(0)  # masked pointer loads through any strides
LOAD_TMA = tl.constexpr(1)  # a TMA descriptor over the operand as stored: A [M, K], B [K, N] (rows, then columns)
LOAD_TMA_T = tl.constexpr(2)  # a TMA descriptor over the transpose as stored: A^T [K, M], B^T [N, K]


@triton.jit
def _load_tile(ptrs, mask, desc, row, col, LOAD: tl.constexpr):
    """One [rows, cols] operand tile at (row, col) of the operand: by pointers, or through TMA (zero-filled
    outside the tensor, as the masked pointer load's other=0)."""
    if LOAD == LOAD_TMA:
        tile = desc.load([row, col])
    elif LOAD == LOAD_TMA_T:
        tile = tl.trans(desc.load([col, row]))
    else:
        tile = tl.load(ptrs, mask=mask, other=0.0)
    return tile


@cached_launch
@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, a_desc, b_desc, bias_ptr, c_ptr,
    M, N, K,
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bk, stride_bn,
    stride_cb, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, A_LOAD: tl.constexpr, B_LOAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """c[b] = a[b] @ b[b] (+ bias): one program per [BLOCK_M, BLOCK_N] tile of c, one sequential K loop, fp32
    accumulator, one rounding. A_LOAD / B_LOAD (LOAD_*): how the operand tiles are loaded (TMA only with a
    batch of one); the tiles, hence the products and their order, are the same either way."""
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
        a = _load_tile(a_ptrs, (offs_m[:, None] < M) & k_ok[None, :], a_desc, pid_m * BLOCK_M, k0, A_LOAD)
        b = _load_tile(b_ptrs, k_ok[:, None] & (offs_n[None, :] < N), b_desc, k0, pid_n * BLOCK_N, B_LOAD)
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


# Tile configurations, chosen in matmul_config from the operand dtype, the rows and b's layout (a row's bits do
# not depend on the tile: docs/kernels.md; tests/mok/test_dense_gpu.py re-proves it for every entry), tuned against
# cuBLAS on the trainer step's GEMMs with bench/linear_sweep.py.
# TMA=1: operands through TMA descriptors where their layout allows (16-bit, one matrix, 16-byte strides).
CONFIGS: dict[str, dict[str, int]] = {
    "fp32": dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=2),
    "narrow": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3),  # N <= 64
    "small": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3),
    "large": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, TMA=1),
    # b stored [N, K] (the forward's weight): taller tiles (the lm_head forward 646 vs 570 TFLOP/s)
    "large_b_nk": dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, TMA=1),
    # decode: the GEMM reads its weight once and is bound by how many programs stream it; the small tiles give a
    # [1, 4096] x [4096, 2048] o_proj 16 programs. 16-row tiles, 32 columns (64 for wide outputs). Why: in CUDA
    # graphs at 1-16 rows they run a qwen3 decode step's qkv / o_proj / router at 0.8-0.9 of cuBLAS (0.3-0.5 with
    # the small tiles), the lm_head at 1.05 (bench/linear_sweep.py --decode). GROUP_M 16: above 16 rows (a decode
    # step of a batch) the row tiles of one column run side by side, so the weight tile comes from HBM once.
    # Any GEMM of few rows takes them, e.g. the weight gradient of a router of 8 experts (rows = experts):
    # same bits, more programs than the small tiles give it (its speed there was not measured).
    "decode_n32": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=16, num_warps=4, num_stages=4),
    "decode_n64": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=16, num_warps=4, num_stages=4),
}
LARGE_ROWS = 1024  # from this many rows (and N > 64) the large tiles
DECODE_ROWS = 16  # up to this many rows (and N > 64) the decode tiles
DECODE_WIDE_PROGRAMS = 256  # enough programs to stream a weight: 64-column decode tiles where they give this many
# (the lm_head); a forward of up to LARGE_ROWS rows keeps to decode tiles while the small tiles give fewer


def _programs(m: int, n: int, config: dict) -> int:
    return triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"])


def matmul_config(m: int, n: int, dtype: torch.dtype, b_nk: bool) -> dict:
    """The one place tile configurations are chosen: from the rows M, columns N, the operand dtype and whether
    b is stored [N, K]. Any choice gives the same bits; the rows pick big tiles only where there are rows to
    fill them. A forward (b stored [N, K], the weight) of a decode step's batch, 17 to 1023 rows, takes the decode
    tiles unless the small tiles give DECODE_WIDE_PROGRAMS programs: at 64 rows a Qwen3-30B-A3B o_proj gets 16
    programs from them (bench/results/vllm-gpu-latest.json, speed_profile: the decode linears at 2.2x cuBLAS)."""
    if dtype == torch.float32:
        return CONFIGS["fp32"]
    if n <= 64:
        return CONFIGS["narrow"]
    if m >= LARGE_ROWS:
        return CONFIGS["large_b_nk" if b_nk else "large"]
    if m > DECODE_ROWS and (not b_nk or _programs(m, n, CONFIGS["small"]) >= DECODE_WIDE_PROGRAMS):
        return CONFIGS["small"]
    return CONFIGS["decode_n64" if _programs(m, n, CONFIGS["decode_n64"]) >= DECODE_WIDE_PROGRAMS else "decode_n32"]


def _tma_operand(t2d: torch.Tensor, block_rows: int, block_cols: int):
    """(LOAD, descriptor) for one [rows, cols] operand: over the tensor as stored when its rows are
    contiguous, over its transpose when its columns are; (LOAD_POINTER, None) when TMA cannot read it."""
    if TensorDescriptor is None or t2d.dtype not in (torch.bfloat16, torch.float16) or t2d.data_ptr() % 16:
        return LOAD_POINTER, None
    rows, cols = t2d.shape
    # rows (or columns) apart in memory: an expanded or overlapping view stays on pointer loads
    if t2d.stride(1) == 1 and t2d.stride(0) >= cols and t2d.stride(0) * t2d.element_size() % 16 == 0:
        return LOAD_TMA, TensorDescriptor(t2d, [rows, cols], [t2d.stride(0), 1], [block_rows, block_cols])
    if t2d.stride(0) == 1 and t2d.stride(1) >= rows and t2d.stride(1) * t2d.element_size() % 16 == 0:
        return LOAD_TMA_T, TensorDescriptor(t2d.t(), [cols, rows], [t2d.stride(1), 1], [block_cols, block_rows])
    return LOAD_POINTER, None


def _launch(a_BTF, b_BFO, bias_O, out_BTO, config: dict | None = None) -> None:
    batch, rows, reduction = a_BTF.shape
    cols = b_BFO.shape[2]
    upcast = a_BTF.dtype != b_BFO.dtype or a_BTF.dtype == torch.float32
    b_nk = b_BFO.stride(1) == 1 and b_BFO.stride(2) != 1
    config = dict(config or matmul_config(rows, cols, torch.float32 if upcast else a_BTF.dtype, b_nk))
    tma = config.pop("TMA", 0) and batch == 1 and not upcast
    block_m, block_n, block_k = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    a_load, a_desc = _tma_operand(a_BTF[0], block_m, block_k) if tma else (LOAD_POINTER, None)
    b_load, b_desc = _tma_operand(b_BFO[0], block_k, block_n) if tma else (LOAD_POINTER, None)
    grid = (triton.cdiv(rows, block_m) * triton.cdiv(cols, block_n), batch)
    _matmul_kernel[grid](
        a_BTF, b_BFO, a_BTF if a_desc is None else a_desc, b_BFO if b_desc is None else b_desc,
        bias_O if bias_O is not None else out_BTO, out_BTO,
        rows, cols, reduction,
        *a_BTF.stride(), *b_BFO.stride(), *out_BTO.stride(),
        HAS_BIAS=bias_O is not None, UPCAST=upcast, A_LOAD=a_load, B_LOAD=b_load, **config,
    )


def matmul(a_BTF: torch.Tensor, b_BFO: torch.Tensor, bias_O: torch.Tensor | None = None, *,
           out_dtype: torch.dtype | None = None, config: dict | None = None) -> torch.Tensor:
    """a @ b (+ bias) with an fp32 accumulator and a sequential F loop. Any strides.

    a: [T, F] or [B, T, F]; b: [F, O] or [B, F, O]; bias: [O] or None. Returns [T, O] / [B, T, O] in
    out_dtype (default a's dtype), rounded once from the fp32 accumulator. `config` (tests, sweeps): a
    CONFIGS entry instead of matmul_config's choice.
    """
    squeeze = a_BTF.dim() == 2
    if squeeze:
        a_BTF, b_BFO = a_BTF[None], b_BFO[None]
    out_BTO = torch.empty(a_BTF.shape[0], a_BTF.shape[1], b_BFO.shape[2], dtype=out_dtype or a_BTF.dtype,
                          device=a_BTF.device)
    _into(a_BTF, b_BFO, bias_O, out_BTO, config)
    return out_BTO[0] if squeeze else out_BTO


def _into(a_BTF: torch.Tensor, b_BFO: torch.Tensor, bias_O: torch.Tensor | None, out_BTO: torch.Tensor,
          config: dict | None = None) -> None:
    """out = a @ b (+ bias) per batch, rounded once to out's dtype, into a tensor of any strides."""
    if not out_BTO.numel():
        return
    if a_BTF.shape[2] == 0:
        out_BTO.zero_()
        if bias_O is not None:
            out_BTO += bias_O.to(out_BTO.dtype)
    else:
        _launch(a_BTF, b_BFO, bias_O, out_BTO, config)


def bmm_nt(a_BTF: torch.Tensor, b_BOF: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Batched a @ b.T: [B, T, F] x [B, O, F] -> [B, T, O] in out_dtype (rounded once from fp32), sequential
    F loop, any strides (the CUDA counterpart of mok.reference.linear.bmm_nt)."""
    return matmul(a_BTF, b_BOF.transpose(-1, -2), out_dtype=out_dtype)


def linear(x_TF: torch.Tensor, w_OF: torch.Tensor, bias_O: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T + bias -> [T, O] in x's dtype (w read in place through its strides)."""
    return matmul(x_TF, w_OF.t(), bias_O, out_dtype=x_TF.dtype)


def head_linear(x_TQF: torch.Tensor, w_QOF: torch.Tensor) -> torch.Tensor:
    """[T, Q, O]: per head q, linear(x[:, q], w[q]) in x's dtype; one launch over the heads (the kernel's batch
    dimension, the same tiles as linear's: the same bits), read and written through strides."""
    out_TQO = torch.empty(x_TQF.shape[0], x_TQF.shape[1], w_QOF.shape[1], dtype=x_TQF.dtype, device=x_TQF.device)
    _into(x_TQF.transpose(0, 1), w_QOF.transpose(-1, -2), None, out_TQO.transpose(0, 1))
    return out_TQO


def head_linear_backward(grad_TQO: torch.Tensor, x_TQF: torch.Tensor, w_QOF: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(d x [T, Q, F] in x's dtype, d w [Q, O, F] in w's dtype): per head, linear's backward (d x = d y @ w,
    d w = d y.T @ x, the latter's loop over tokens in order), one launch each over the heads."""
    grad_x_TQF = torch.empty_like(x_TQF, memory_format=torch.contiguous_format)
    grad_w_QOF = torch.empty_like(w_QOF, memory_format=torch.contiguous_format)
    _into(grad_TQO.transpose(0, 1), w_QOF, None, grad_x_TQF.transpose(0, 1))
    _into(grad_TQO.permute(1, 2, 0), x_TQF.transpose(0, 1), None, grad_w_QOF)
    return grad_x_TQF, grad_w_QOF


# The native eager path's sites (mok/kernels/native): the launches of linear and of mok.linear's backward (d x = d y @ w
# and d w = d y.T @ x through bmm_nt), on the views matmul and bmm_nt make, into outputs the caller allocated as matmul
# does (contiguous, x's dtype for out and d x, w's for d w). T, F and O are not 0 (the caller fills those itself).


def forward_site(per_call: tuple, scalars: tuple) -> None:
    """per_call: (x_TF, w_OF, out_TO) or (x_TF, w_OF, bias_O, out_TO); scalars: (has_bias,)."""
    x_TF, w_OF, *bias_O, out_TO = per_call
    _launch(x_TF[None], w_OF.t()[None], bias_O[0] if scalars[0] else None, out_TO[None])


def backward_site(per_call: tuple, scalars: tuple) -> None:
    """per_call: (grad_TO contiguous, x_TF, w_OF, grad_x_TF, grad_w_OF); scalars: ()."""
    grad_TO, x_TF, w_OF, grad_x_TF, grad_w_OF = per_call
    _launch(grad_TO[None], w_OF.t()[None].transpose(-1, -2), None, grad_x_TF[None])
    _launch(grad_TO.t()[None], x_TF.t()[None].transpose(-1, -2), None, grad_w_OF[None])
