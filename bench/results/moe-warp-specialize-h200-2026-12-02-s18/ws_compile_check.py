"""Warp specialisation of the MoE GEMMs under Triton 3.6 for sm_90, compiled on a CPU machine (no GPU): for each
kernel and config, whether the compile succeeds, whether the TTGIR holds a ttg.warp_specialize region, and the
registers / spill stack / shared memory / warps of the cubin; with --compare OLD.py, whether the PTX of every config
with WARP_SPECIALIZE off equals that of OLD.py's kernels (sources extracted by
bench/results/sm90-resources-triton36-2026-12-01-s9/extract_sources.py; debug sections, .loc / .file lines
dropped).

    python3 extract_sources.py /tmp/new.py      # from this tree; again from the commit before for /tmp/old.py
    /path/to/python-with-triton-3.6 ws_compile_check.py /tmp/new.py [--compare /tmp/old.py]
"""
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

INT_PTRS = ("ids_ptr", "slots_ptr", "start_ptr", "expert_ptr", "tiles_ptr")


def load(path):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def build(kernel, const, descs, ones, warps, stages, fp32_ptrs=()):
    names = kernel.arg_names
    const = {k: v for k, v in const.items() if k in names}  # WARP_SPECIALIZE is absent from the old kernels
    ptrs = {n: "*i32" if n.endswith(INT_PTRS) else "*fp32" if n in fp32_ptrs else "*bf16"
            for n in names if n.endswith("_ptr")}
    sig = {n: "constexpr" if n in const or n in ones else ptrs.get(n, "i32") for n in names}
    sig.update(descs)
    constexprs = {(names.index(k),): v for k, v in const.items()}
    constexprs.update({(names.index(n),): 1 for n in ones})
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ptrs}
    return triton.compile(ASTSource(kernel, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages))


def gemm1(m, bm, bn, bk, warps, stages, ws):
    const = dict(TOP_K=8, SAVE_GATE_UP=True, UPCAST=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, TMA_B=True,
                 SCANNED=False, BLOCK_T=1, BLOCK_KP=1, PDL=True, WARP_SPECIALIZE=ws)
    return build(m._gemm1_swiglu_kernel, const, {"w13_desc": f"tensordesc<bf16[{bn}, {bk}]>"},
                 ("stride_xh", "stride_wk"), warps, stages)


def grouped(m, bm, bn, bk, warps, stages, ws, kind):
    # gemm2: B[e] = w2[e] stored [n, k] (TMA_B 1), y by slot; bwd_act: d y sorted, w2[e] stored [k, n] (TMA_B 2),
    # SwiGLU backward; bwd_dx: w13[e] stored [k, n], fp32 d hidden by slot
    swiglu = kind == "bwd_act"
    tma_b = 1 if kind == "gemm2" else 2
    const = dict(A_ROWS=0, C_ROWS=0 if swiglu else 1, SWIGLU_BACKWARD=swiglu, LEAN_EPILOGUE=1, TOP_K=8, UPCAST=False,
                 BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, TMA_A=True, TMA_B=tma_b, SCANNED=False, BLOCK_T=1,
                 BLOCK_KP=1, PDL=True, PREFETCH_K=0, LINE=64, WARP_SPECIALIZE=ws)
    b_block = f"[{bn}, {bk}]" if tma_b == 1 else f"[{bk}, {bn}]"
    ones = ("stride_ak", "stride_bk" if tma_b == 1 else "stride_bn", "stride_cn")
    return build(m._grouped_gemm_kernel, const,
                 {"a_desc": f"tensordesc<bf16[{bm}, {bk}]>", "b_desc": f"tensordesc<bf16{b_block}>"}, ones, warps,
                 stages, fp32_ptrs=("c_ptr",) if kind == "bwd_dx" else ())


def weight_grad(m, bm, bn, bk, warps, stages, ws):
    const = dict(A_ROWS=0, B_ROWS=0, TOP_K=8, UPCAST=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, TMA_A=True,
                 TMA_B=True, WARP_SPECIALIZE=ws)
    return build(m._weight_grad_kernel, const, {"a_desc": f"tensordesc<bf16[{bk}, {bm}]>",
                                                "b_desc": f"tensordesc<bf16[{bk}, {bn}]>"},
                 ("stride_ac", "stride_bc", "stride_cn"), warps, stages)


CASES = [  # (kernel, builder, kind, (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages))
    ("gemm1", gemm1, None, (128, 128, 64, 8, 4)), ("gemm1", gemm1, None, (128, 64, 64, 4, 4)),
    ("gemm2", grouped, "gemm2", (128, 256, 64, 8, 3)), ("gemm2", grouped, "gemm2", (128, 128, 64, 4, 3)),
    ("gemm2", grouped, "gemm2", (128, 128, 64, 4, 4)),
    ("bwd_act", grouped, "bwd_act", (128, 128, 64, 8, 3)), ("bwd_act", grouped, "bwd_act", (128, 128, 64, 4, 3)),
    ("bwd_act", grouped, "bwd_act", (128, 128, 64, 4, 4)),
    ("bwd_dx", grouped, "bwd_dx", (128, 256, 64, 8, 3)), ("bwd_dx", grouped, "bwd_dx", (128, 128, 64, 4, 3)),
    ("bwd_dx", grouped, "bwd_dx", (128, 128, 64, 4, 4)),
    ("weight_grad", weight_grad, None, (128, 256, 64, 8, 3)), ("weight_grad", weight_grad, None, (128, 128, 64, 4, 3)),
    ("weight_grad", weight_grad, None, (128, 128, 64, 4, 4)),
]


def compile_case(module, builder, kind, cfg, ws):
    return builder(module, *cfg, ws) if kind is None else builder(module, *cfg, ws, kind)


def resources(compiled):
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    return re.findall(r"REG:\d+ STACK:\d+", text)[-1] + f" SHARED:{compiled.metadata.shared}"


def code(ptx):
    """The PTX's instructions: up to its DWARF sections, without .loc / .file lines and comments."""
    ptx = ptx.split(".section\t.debug")[0].split(".section .debug")[0]
    return [line for line in ptx.splitlines() if not line.lstrip().startswith((".loc", ".file", "//"))]


def main():
    new = load(sys.argv[1])
    old = load(sys.argv[sys.argv.index("--compare") + 1]) if "--compare" in sys.argv else None
    print(f"triton {triton.__version__}, sm_90")
    for name, builder, kind, cfg in CASES:
        label = f"{name} {cfg[0]}x{cfg[1]} BK{cfg[2]} {cfg[3]} warps {cfg[4]} stages"
        for ws in (False, True):
            try:
                compiled = compile_case(new, builder, kind, cfg, ws)
            except Exception as err:
                print(f"{label} WS={int(ws)}: compile FAILED ({type(err).__name__}: {str(err)[:120]})", flush=True)
                continue
            line = (f"{label} WS={int(ws)}: ws region {'ttg.warp_specialize' in compiled.asm['ttgir']}, "
                    f"warps {compiled.metadata.num_warps}, {resources(compiled)}")
            if old is not None and not ws:
                same = code(compile_case(old, builder, kind, cfg, False).asm["ptx"]) == code(compiled.asm["ptx"])
                line += f", PTX equal to the old kernel's: {same}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
