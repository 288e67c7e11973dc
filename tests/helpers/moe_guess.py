"""A Triton kernel over GEMM 1's expert guess (mok/kernels/moe/grouped_gemm.py, _guess_expert) for the interpreter
tests: one program per slot stores the expert guessed for (slot // K, slot % K)."""
import triton
import triton.language as tl

from mok.kernels.moe.grouped_gemm import _guess_expert


@triton.jit
def guess_experts_kernel(logits_ptr, out_ptr, num_experts, stride_lt, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr):
    slot = tl.program_id(0)
    tl.store(out_ptr + slot, _guess_expert(logits_ptr, stride_lt, num_experts, slot // TOP_K, slot % TOP_K, TOP_K,
                                           BLOCK_E))
