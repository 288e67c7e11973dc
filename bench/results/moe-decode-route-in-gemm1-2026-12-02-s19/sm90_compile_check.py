"""The routing code of the routing kernel and of GEMM 1 with ROUTE, compiled by Triton 3.6 for sm_90 on a CPU machine
(no GPU): whether each compiles, its registers, spills, barriers and shuffles. From the repository root:

    PYTHONPATH=/path/to/triton-3.6 python bench/results/moe-decode-route-in-gemm1-2026-12-02-s19/sm90_compile_check.py
"""
import ast
import importlib.util
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SOURCES = [("mok/kernels/launch.py", {"wait_for_predecessor"}, False),
           ("mok/kernels/moe/routing.py", None, False),
           ("mok/kernels/moe/schedule.py", {"valid_ids"}, False),
           ("mok/kernels/moe/grouped_gemm.py", None, True)]


def extracted_module():
    """The @triton.jit functions of SOURCES (and grouped_gemm.py's constexpr constants) in one module, no torch."""
    out = ["import triton", "import triton.language as tl", ""]
    for path, names, consts in SOURCES:
        src = open(path).read()
        lines = src.splitlines()
        for node in ast.parse(src).body:
            if consts and isinstance(node, ast.Assign) and "tl.constexpr(" in ast.get_source_segment(src, node):
                out.append(ast.get_source_segment(src, node))
            if isinstance(node, ast.FunctionDef) and any(
                    ast.get_source_segment(src, d).startswith("triton.jit") for d in node.decorator_list):
                if names is None or node.name in names:
                    out.append("@triton.jit\n" + "\n".join(lines[node.lineno - 1: node.end_lineno]) + "\n")
    path = os.path.join(tempfile.mkdtemp(), "extracted36.py")
    open(path, "w").write("\n".join(out) + "\n")
    spec = importlib.util.spec_from_file_location("extracted36", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile_report(kernel, const, pointers, ints16, warps, label):
    """Compile with `const` constexprs, pointer args typed as `pointers` says (16-byte aligned), the int args in
    ints16 divisible by 16 (as the launcher's values are), the rest i32."""
    names = kernel.arg_names
    sig = {n: "constexpr" if n in const else pointers.get(n, "i32") for n in names}
    constexprs = {(names.index(a),): v for a, v in const.items()}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in list(pointers) + list(ints16)}
    try:
        compiled = triton.compile(ASTSource(kernel, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=warps))
    except Exception as err:  # noqa: BLE001 - the report says which failed and why
        print(f"{label}: FAILED {type(err).__name__}: {str(err).splitlines()[0][:200]}")
        return
    ptx = compiled.asm["ptx"].split(".section\t.debug")[0]
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    usage = re.findall(r"REG:\d+ STACK:\d+", subprocess.run([tool, "-res-usage", f.name], capture_output=True,
                                                            text=True).stdout)[-1]
    print(f"{label}: {usage} SHARED:{compiled.metadata.shared}; "
          f"bar.sync {len(re.findall(r'bar.sync', ptx))}, shfl.sync.bfly {len(re.findall(r'shfl.sync.bfly', ptx))}, "
          f"add.f32 {len(re.findall(r'add.f32', ptx))}")


def main():
    m = extracted_module()
    f32, i32 = "*fp32", "*i32"
    for num_experts, top_k in ((128, 8), (64, 8), (256, 8), (8, 2)):
        block_e = triton.next_power_of_2(num_experts)
        for warps in sorted({1 if block_e < 256 else 4, 4}):
            compile_report(m._route_kernel, dict(TOP_K=top_k, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
                                                 RENORMALIZE=True, REPLAY=False, PDL=True),
                           dict(logits_ptr=f32, ids_ptr=i32, weights_ptr=f32, probs_ptr=f32),
                           ("num_experts", "stride_logits") if num_experts % 16 == 0 else ("stride_logits",) * 0,
                           warps, f"_route_kernel E={num_experts} K={top_k} warps={warps}")
    bf16 = "*bf16"
    gemm1_ptrs = dict(x_ptr=bf16, w13_ptr=bf16, w13_desc=bf16, gate_up_ptr=bf16, act_ptr=bf16, logits_ptr=f32,
                      weights_ptr=f32, ids_ptr=i32, sorted_slots_ptr=i32, expert_start_ptr=i32, tile_expert_ptr=i32,
                      tile_row_start_ptr=i32, num_tiles_ptr=i32)
    for label, num_experts, top_k in (("qwen3-30b-a3b", 128, 8), ("olmoe-1b-7b", 64, 8), ("mixtral-8x7b", 8, 2)):
        for route in (False, True):
            const = dict(TOP_K=top_k, SAVE_GATE_UP=False, UPCAST=False, BLOCK_M=16, BLOCK_N=32, BLOCK_K=64,
                         GROUP_M=1, TMA_B=0, SCANNED=True, BLOCK_T=1, BLOCK_KP=triton.next_power_of_2(top_k),
                         PDL=True, ROUTE=route, RENORMALIZE=True,
                         BLOCK_E=triton.next_power_of_2(num_experts) if route else 1)
            ints16 = ["max_tiles", "inter", "hidden", "stride_xt", "stride_we", "stride_wn"]
            ints16 += ["num_experts", "stride_logits"] if num_experts % 16 == 0 else []
            compile_report(m._gemm1_swiglu_kernel, const, gemm1_ptrs, ints16, 4,
                           f"_gemm1_swiglu_kernel {label} T=1 ROUTE={int(route)}")


if __name__ == "__main__":
    main()
