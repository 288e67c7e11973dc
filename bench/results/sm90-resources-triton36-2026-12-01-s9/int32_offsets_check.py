"""GEMM 1's INT32_OFFSETS (mok/kernels/moe/grouped_gemm.py) under Triton 3.6 for sm_90, compiled on a CPU machine:
with the flag off the kernel's PTX (code, debug sections left out) equals the previous commit's; with it on, the
spill space per thread. Usage as lean_epilogue_check.py:
    /path/to/py312-with-triton-3.6/bin/python int32_offsets_check.py OLD_EXTRACT.py NEW_EXTRACT.py
cfg: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SAVE_GATE_UP, TMA_B)."""
import os
import sys

sys.argv, paths = sys.argv[:1], sys.argv[1:]
here = os.path.dirname(os.path.abspath(__file__))
check = open(os.path.join(here, "lean_epilogue_check.py")).read().split("head, new = ")[0]
exec(check)  # load, strip, usage (the same helpers)


def gemm1(kernel, BM, BN, BK, warps, stages, save, tma, int32=None):
    names = kernel.arg_names
    ptr = {n: ("*i32" if n.endswith(("ids_ptr", "slots_ptr", "start_ptr", "expert_ptr", "tiles_ptr")) else "*bf16")
           for n in names if n.endswith("_ptr")}
    const = dict(TOP_K=8, SAVE_GATE_UP=save, UPCAST=False, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=8, TMA_B=tma,
                 SCANNED=False, BLOCK_T=1, BLOCK_KP=1, PDL=True)
    if int32 is not None:
        const["INT32_OFFSETS"] = int32
    sig = {n: "constexpr" if n in const else ptr.get(n, "i32") for n in names}
    sig["w13_desc"] = f"tensordesc<bf16[{BN}, {BK}]>" if tma else "*bf16"
    cx = {(names.index(k),): v for k, v in const.items()}
    for n in ("stride_xh", "stride_wk"):
        sig[n] = "constexpr"
        cx[(names.index(n),)] = 1
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ptr}
    return triton.compile(ASTSource(kernel, sig, cx, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages))


head, new = load(paths[0]), load(paths[1])
print("triton", triton.__version__)
for cfg in [(128, 128, 64, 8, 4, True, True), (128, 128, 64, 8, 4, False, True), (16, 32, 64, 4, 4, False, False),
            (64, 64, 64, 4, 4, True, False)]:
    a = gemm1(head._gemm1_swiglu_kernel, *cfg)
    b = gemm1(new._gemm1_swiglu_kernel, *cfg, int32=False)
    c = gemm1(new._gemm1_swiglu_kernel, *cfg, int32=True)
    print(f"{cfg}: flag off PTX identical to the previous commit's: {strip(a.asm['ptx']) == strip(b.asm['ptx'])}; "
          f"before {usage(a)}, flag on {usage(c)}", flush=True)
