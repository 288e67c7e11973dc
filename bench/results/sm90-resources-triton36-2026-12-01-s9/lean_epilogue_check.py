"""bwd_act's LEAN_EPILOGUE (mok/kernels/moe/grouped_gemm.py) under Triton 3.6 for sm_90, compiled on a CPU machine:
with the flag off the kernel's PTX (code, debug sections left out) equals the previous commit's, and with it on the
spill space per thread. Usage: extract_sources.py on the previous and the new tree (two files), then
    /path/to/py312-with-triton-3.6/bin/python lean_epilogue_check.py OLD_EXTRACT.py NEW_EXTRACT.py
cfg: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SwiGLU backward, GATE_UP_FIRST)."""
import sys, re, importlib.util, os, subprocess, tempfile
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
def load(path):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    m = importlib.util.module_from_spec(spec); sys.modules[spec.name] = m; spec.loader.exec_module(m); return m
def compile_(kernel, BM, BN, BK, warps, stages, swiglu, guf, lean=None, c_fp32=False, c_rows=0):
    names = kernel.arg_names
    ptr = {n: ("*i32" if n.endswith(("ids_ptr", "slots_ptr", "start_ptr", "expert_ptr", "tiles_ptr")) else "*bf16") for n in names if n.endswith("_ptr")}
    if c_fp32:
        ptr["c_ptr"] = "*fp32"
    const = dict(A_ROWS=0, C_ROWS=c_rows, SWIGLU_BACKWARD=swiglu, GATE_UP_FIRST=guf, TOP_K=8, UPCAST=False, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=8, TMA_A=True, TMA_B=2, SCANNED=False, BLOCK_T=1, BLOCK_KP=1, PDL=True, PREFETCH_K=0, LINE=64)
    if lean is None and "LEAN_EPILOGUE" in names:
        lean = False  # a previous commit that has the flag: compare with it off
    if lean is not None: const["LEAN_EPILOGUE"] = lean
    sig = {n: "constexpr" if n in const else ptr.get(n, "i32") for n in names}
    sig["a_desc"], sig["b_desc"] = f"tensordesc<bf16[{BM}, {BK}]>", f"tensordesc<bf16[{BK}, {BN}]>"
    cx = {(names.index(k),): v for k, v in const.items()}
    for n in ("stride_ak", "stride_bn", "stride_cn"):
        sig[n] = "constexpr"; cx[(names.index(n),)] = 1
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ptr}
    k = triton.compile(ASTSource(kernel, sig, cx, attrs), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    return k
def strip(ptx):
    ptx = ptx.split(".section\t.debug")[0].split(".section .debug")[0]
    return "\n".join(l for l in ptx.splitlines() if not l.strip().startswith((".loc", ".file", "//")))
def usage(k):
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f: f.write(k.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    return re.findall(r"REG:\d+ STACK:\d+", subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout)[-1]
head, new = load(sys.argv[1]), load(sys.argv[2])
print("triton", triton.__version__)
for cfg in [(128,128,64,8,4,True,True),(128,128,64,8,4,True,False),(128,256,64,8,3,False,False),(64,128,64,4,4,True,False),
            (128,256,64,8,3,True,False),(64,256,64,4,3,True,False)]:
    a = compile_(head._grouped_gemm_kernel, *cfg); b = compile_(new._grouped_gemm_kernel, *cfg, lean=False)
    same = strip(a.asm["ptx"]) == strip(b.asm["ptx"])
    c = compile_(new._grouped_gemm_kernel, *cfg, lean=True)
    print(f"{cfg}: lean off PTX identical to HEAD: {same}; HEAD {usage(a)}, lean on {usage(c)}", flush=True)
# plain epilogues (no SwiGLU backward): GEMM 2 (bf16 C in slot order), bwd_dx (fp32 C)
for label, cfg, extra in [("gemm2 large", (128, 256, 64, 8, 3, False, False), dict(c_rows=1)),
                          ("bwd_dx xlarge", (128, 256, 64, 8, 3, False, False), dict(c_fp32=True))]:
    a = compile_(head._grouped_gemm_kernel, *cfg, **extra)
    b = compile_(new._grouped_gemm_kernel, *cfg, lean=False, **extra)
    c = compile_(new._grouped_gemm_kernel, *cfg, lean=True, **extra)
    print(f"{label} {cfg}: lean off PTX identical to HEAD: {strip(a.asm['ptx']) == strip(b.asm['ptx'])}; "
          f"HEAD {usage(a)}, lean on {usage(c)}", flush=True)
