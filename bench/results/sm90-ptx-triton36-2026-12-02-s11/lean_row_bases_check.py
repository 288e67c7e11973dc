"""The eleventh session's change to mok/kernels/moe/grouped_gemm.py under Triton 3.6 for sm_90, compiled on a CPU
machine: with LEAN_EPILOGUE 0 and 1 the grouped GEMM's PTX (code, debug sections left out) equals the tenth
session's last commit's (4cd76bf), and LEAN_EPILOGUE 2's (int64 row bases) registers and stack. Usage: the
s9 folder's extract_sources.py on both trees, then
    /path/to/py312-with-triton-3.6/bin/python lean_row_bases_check.py OLD_EXTRACT.py NEW_EXTRACT.py
cfg: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SwiGLU backward)."""
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def load(path):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    m = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = m
    spec.loader.exec_module(m)
    return m


def compile_(kernel, BM, BN, BK, warps, stages, swiglu, lean, c_fp32=False, c_rows=0, group_m=8):
    names = kernel.arg_names
    ptr = {n: ("*i32" if n.endswith(("ids_ptr", "slots_ptr", "start_ptr", "expert_ptr", "tiles_ptr")) else "*bf16")
           for n in names if n.endswith("_ptr")}
    if c_fp32:
        ptr["c_ptr"] = "*fp32"
    const = dict(A_ROWS=0, C_ROWS=c_rows, SWIGLU_BACKWARD=swiglu, LEAN_EPILOGUE=lean, TOP_K=8, UPCAST=False,
                 BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=group_m, TMA_A=True, TMA_B=2, SCANNED=False, BLOCK_T=1,
                 BLOCK_KP=1, PDL=True, PREFETCH_K=0, LINE=64)
    sig = {n: "constexpr" if n in const else ptr.get(n, "i32") for n in names}
    sig["a_desc"], sig["b_desc"] = f"tensordesc<bf16[{BM}, {BK}]>", f"tensordesc<bf16[{BK}, {BN}]>"
    cx = {(names.index(k),): v for k, v in const.items()}
    for n in ("stride_ak", "stride_bn", "stride_cn"):
        sig[n] = "constexpr"
        cx[(names.index(n),)] = 1
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ptr}
    return triton.compile(ASTSource(kernel, sig, cx, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages))


def strip(ptx):
    ptx = ptx.split(".section\t.debug")[0].split(".section .debug")[0]
    return "\n".join(line for line in ptx.splitlines() if not line.strip().startswith((".loc", ".file", "//")))


def usage(k):
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    return re.findall(r"REG:\d+ STACK:\d+", out)[-1]


old, new = load(sys.argv[1]), load(sys.argv[2])
print("triton", triton.__version__)
cases = [("bwd_act large (now wide hidden)", (128, 256, 64, 8, 3, True), {}),
         ("bwd_act large (now)", (128, 128, 64, 8, 3, True), {}),
         ("bwd_act xlarge", (128, 128, 64, 8, 4, True), {}),
         ("bwd_act decode", (16, 64, 64, 4, 4, True), {"group_m": 1}),
         ("bwd_act small", (64, 64, 64, 4, 4, True), {"group_m": 4}),
         ("gemm2 large", (128, 256, 64, 8, 3, False), {"c_rows": 1}),
         ("bwd_dx large", (128, 256, 64, 8, 3, False), {"c_fp32": True, "c_rows": 1})]
for label, cfg, extra in cases:
    line = [f"{label} {cfg}:"]
    for lean in (0, 1):
        a = compile_(old._grouped_gemm_kernel, *cfg, lean=bool(lean), **extra)
        b = compile_(new._grouped_gemm_kernel, *cfg, lean=lean, **extra)
        line.append(f"LEAN {lean} PTX identical to 4cd76bf: {strip(a.asm['ptx']) == strip(b.asm['ptx'])} ({usage(b)});")
    c = compile_(new._grouped_gemm_kernel, *cfg, lean=2, **extra)
    line.append(f"LEAN 2 {usage(c)}")
    print(" ".join(line), flush=True)


def opcodes(ptx):
    """The instructions of the PTX as a multiset of opcodes (register numbers and labels left out)."""
    counts = {}
    for line in strip(ptx).splitlines():
        line = line.strip()
        if not line or line.startswith((".", "$", "{", "}", "@")) and not line.startswith("@%"):
            continue
        op = line.split()[0] if not line.startswith("@") else line.split()[1]
        counts[op] = counts.get(op, 0) + 1
    return counts


print("where the PTX differs: instruction counts (opcode multisets) of 4cd76bf and now")
for label, cfg, extra in cases:
    for lean in (0, 1):
        a = compile_(old._grouped_gemm_kernel, *cfg, lean=bool(lean), **extra)
        b = compile_(new._grouped_gemm_kernel, *cfg, lean=lean, **extra)
        if strip(a.asm["ptx"]) != strip(b.asm["ptx"]):
            ca, cb = opcodes(a.asm["ptx"]), opcodes(b.asm["ptx"])
            delta = {op: cb.get(op, 0) - ca.get(op, 0) for op in set(ca) | set(cb) if cb.get(op, 0) != ca.get(op, 0)}
            print(f"{label} {cfg} LEAN {lean}: {sum(ca.values())} -> {sum(cb.values())} instructions, "
                  f"old {usage(a)}, now {usage(b)}, changed opcodes {delta}", flush=True)
