"""Registers, stack (spill space) and shared memory of the MoE grouped-GEMM kernel's bwd_act and plain configs,
compiled for sm_90 on a CPU machine by Triton 3.6 (the H200 machine's version), from sources extracted by
extract_sources.py (Triton's jit functions only, so no torch is needed). Usage, from the repository root:
    python extract_sources.py /tmp/gg36.py          # any Python with the repository's files
    /path/to/py312-with-triton-3.6/bin/python resources.py /tmp/gg36.py [variant]
variant: none (the sources as they are), or one of the epilogue rewrites below applied to the extracted copy
(nothing in mok changes): defer (gate/up pointers and the mask built after the K loop), int32 (defer + the
epilogue's row offsets in int32), halves (int32 + the SwiGLU-backward epilogue in two column halves)."""
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

DEFER = [('''    mask_mn = mask_m[:, None] & mask_n[None, :]
    if SWIGLU_BACKWARD:
        gu_ptrs = gate_up_ptr + positions[:, None] * (2 * n_cols) + offs_n[None, :]
        if GATE_UP_FIRST:
            gate_in = tl.load(gu_ptrs, mask=mask_mn, other=0.0)
            up_in = tl.load(gu_ptrs + n_cols, mask=mask_mn, other=0.0)
''', '''    if SWIGLU_BACKWARD:
        if GATE_UP_FIRST:
            gu_ptrs = gate_up_ptr + positions[:, None] * (2 * n_cols) + offs_n[None, :]
            gate_in = tl.load(gu_ptrs, mask=mask_m[:, None] & mask_n[None, :], other=0.0)
            up_in = tl.load(gu_ptrs + n_cols, mask=mask_m[:, None] & mask_n[None, :], other=0.0)
'''), ('''    out_dtype = c_ptr.dtype.element_ty
    if SWIGLU_BACKWARD:
        if not GATE_UP_FIRST:
            gate_in = tl.load(gu_ptrs, mask=mask_mn, other=0.0)''', '''    out_dtype = c_ptr.dtype.element_ty
    mask_mn = mask_m[:, None] & mask_n[None, :]
    if SWIGLU_BACKWARD:
        if not GATE_UP_FIRST:
            gu_ptrs = gate_up_ptr + positions[:, None] * (2 * n_cols) + offs_n[None, :]
            gate_in = tl.load(gu_ptrs, mask=mask_mn, other=0.0)''')]
INT32 = [('''            gu_ptrs = gate_up_ptr + positions[:, None] * (2 * n_cols) + offs_n[None, :]
            gate_in = tl.load(gu_ptrs, mask=mask_mn, other=0.0)''', '''            gu_ptrs = gate_up_ptr + (positions.to(tl.int32)[:, None] * (2 * n_cols) + offs_n[None, :])
            gate_in = tl.load(gu_ptrs, mask=mask_mn, other=0.0)'''),
         ('''        c_ptrs = c_ptr + c_rows[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, grad_gate.to(out_dtype), mask=mask_mn)''', '''        c_ptrs = c_ptr + (c_rows.to(tl.int32)[:, None] * stride_cm + offs_n[None, :] * stride_cn)
        tl.store(c_ptrs, grad_gate.to(out_dtype), mask=mask_mn)''')]
HALF_HELPER = '''@triton.jit
def _swiglu_backward_half(acc, gate_up_ptr, c_ptr, positions, c_rows, offs_n, mask_m, n_cols, stride_cm, stride_cn):
    mask_mn = mask_m[:, None] & (offs_n < n_cols)[None, :]
    gu_ptrs = gate_up_ptr + (positions.to(tl.int32)[:, None] * (2 * n_cols) + offs_n[None, :])
    gate = tl.load(gu_ptrs, mask=mask_mn, other=0.0).to(tl.float32)
    up = tl.load(gu_ptrs + n_cols, mask=mask_mn, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    grad_gate = acc * up * sig * (1.0 + gate * (1.0 - sig))
    grad_up = acc * (gate * sig)
    c_ptrs = c_ptr + (c_rows.to(tl.int32)[:, None] * stride_cm + offs_n[None, :] * stride_cn)
    tl.store(c_ptrs, grad_gate.to(c_ptr.dtype.element_ty), mask=mask_mn)
    tl.store(c_ptrs + n_cols * stride_cn, grad_up.to(c_ptr.dtype.element_ty), mask=mask_mn)


@triton.jit
def _grouped_gemm_kernel('''
HALVES_START = "    out_dtype = c_ptr.dtype.element_ty\n    mask_mn = mask_m[:, None] & mask_n[None, :]\n    if SWIGLU_BACKWARD:\n"
HALVES_END = "    else:\n        c_ptrs = c_ptr + c_rows[:, None] * stride_cm"
HALVES_BODY = '''    out_dtype = c_ptr.dtype.element_ty
    mask_mn = mask_m[:, None] & mask_n[None, :]
    if SWIGLU_BACKWARD and not GATE_UP_FIRST:
        acc_lo, acc_hi = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, BLOCK_N // 2]), [0, 2, 1]))
        half = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 2)
        _swiglu_backward_half(acc_lo, gate_up_ptr, c_ptr, positions, c_rows, half, mask_m, n_cols, stride_cm,
                              stride_cn)
        _swiglu_backward_half(acc_hi, gate_up_ptr, c_ptr, positions, c_rows, half + BLOCK_N // 2, mask_m, n_cols,
                              stride_cm, stride_cn)
    elif SWIGLU_BACKWARD:
        gate = gate_in.to(tl.float32)
        up = up_in.to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-gate))
        grad_gate = acc * up * sig * (1.0 + gate * (1.0 - sig))
        grad_up = acc * (gate * sig)
        c_ptrs = c_ptr + c_rows[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, grad_gate.to(out_dtype), mask=mask_mn)
        tl.store(c_ptrs + n_cols * stride_cn, grad_up.to(out_dtype), mask=mask_mn)
'''


def patched(path: str, variant: str) -> str:
    src = open(path).read()
    steps = {"none": [], "defer": DEFER, "int32": DEFER + INT32, "halves": DEFER + INT32}[variant]
    for old, new in steps:
        assert old in src, old[:60]
        src = src.replace(old, new, 1)
    if variant == "halves":
        src = src.replace("@triton.jit\ndef _grouped_gemm_kernel(", HALF_HELPER, 1)
        i, j = src.index(HALVES_START), src.index(HALVES_END)
        src = src[:i] + HALVES_BODY + src[j:]
    out = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False, dir=os.path.dirname(path))
    out.write(src)
    out.close()
    return out.name


def load(path):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def usage(kernel, BM, BN, BK, warps, stages, swiglu, gate_up_first):
    names = kernel.arg_names
    ptr = {n: ("*i32" if n.endswith(("ids_ptr", "slots_ptr", "start_ptr", "expert_ptr", "tiles_ptr")) else "*bf16")
           for n in names if n.endswith("_ptr")}
    const = dict(A_ROWS=0, C_ROWS=0, SWIGLU_BACKWARD=swiglu, GATE_UP_FIRST=gate_up_first, TOP_K=8, UPCAST=False,
                 BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=8, TMA_A=True, TMA_B=2, SCANNED=False, BLOCK_T=1,
                 BLOCK_KP=1, PDL=True, PREFETCH_K=0, LINE=64)
    sig = {n: "constexpr" if n in const else ptr.get(n, "i32") for n in names}
    sig["a_desc"], sig["b_desc"] = f"tensordesc<bf16[{BM}, {BK}]>", f"tensordesc<bf16[{BK}, {BN}]>"
    constexprs = {(names.index(k),): v for k, v in const.items()}
    for n in ("stride_ak", "stride_bn", "stride_cn"):
        sig[n] = "constexpr"
        constexprs[(names.index(n),)] = 1
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ptr}
    compiled = triton.compile(ASTSource(kernel, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, num_stages=stages))
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    return re.findall(r"REG:\d+ STACK:\d+", text)[-1] + f" SHARED:{compiled.metadata.shared}"


if __name__ == "__main__":
    variant = sys.argv[2] if len(sys.argv) > 2 else "none"
    module = load(patched(sys.argv[1], variant))
    print(f"triton {triton.__version__}, variant {variant}")
    for label, cfg in [("bwd_act 128x128 8 warps 4 stages GATE_UP_FIRST (large today)", (128, 128, 64, 8, 4, True, True)),
                       ("bwd_act 128x128 8 warps 4 stages (xlarge today)", (128, 128, 64, 8, 4, True, False)),
                       ("bwd_act 128x256 8 warps 3 stages", (128, 256, 64, 8, 3, True, False)),
                       ("bwd_act 64x128 4 warps 4 stages", (64, 128, 64, 4, 4, True, False)),
                       ("plain 128x128 8 warps 4 stages", (128, 128, 64, 8, 4, False, False)),
                       ("plain 128x256 8 warps 3 stages (gemm2 / bwd_dx today)", (128, 256, 64, 8, 3, False, False))]:
        print(f"{label}: {usage(module._grouped_gemm_kernel, *cfg)}", flush=True)
