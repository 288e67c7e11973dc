"""The routing kernel compiled by Triton 3.6 for sm_90 on a CPU machine (no GPU), BLOCK_E 128 (qwen3-30b-a3b), with
1 warp (what the launcher uses below 256 experts) and with 4 (GEMM 1's decode warps): the layout of its [BLOCK_E]
vectors and the reduction instructions in its PTX. From the repository root:

    /path/to/python-with-triton-3.6 bench/results/moe-decode-route-share-h200-2026-12-02-s18/route_sum_tree_check.py
"""
import ast
import importlib.util
import os
import re
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def extracted_route_kernel():
    """_route_kernel's source alone (no torch), with wait_for_predecessor as a no-op (PDL off here)."""
    src = open("mok/kernels/moe/routing.py").read()
    lines = src.splitlines()
    out = ["import triton", "import triton.language as tl", "",
           "@triton.jit\ndef wait_for_predecessor(PDL: tl.constexpr):\n    pass\n"]
    for node in ast.parse(src).body:
        if isinstance(node, ast.FunctionDef) and node.name == "_route_kernel":
            out.append("@triton.jit\n" + "\n".join(lines[node.lineno - 1: node.end_lineno]))
    path = os.path.join(tempfile.mkdtemp(), "route36.py")
    open(path, "w").write("\n".join(out) + "\n")
    spec = importlib.util.spec_from_file_location("route36", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._route_kernel


def main():
    kernel = extracted_route_kernel()
    names = kernel.arg_names
    const = dict(TOP_K=8, BLOCK_E=128, BLOCK_K=8, RENORMALIZE=True, REPLAY=False, PDL=False)
    floats, ints = ("logits_ptr", "weights_ptr", "probs_ptr"), ("ids_ptr",)
    sig = {n: "constexpr" if n in const else "*fp32" if n in floats else "*i32" if n in ints else "i32" for n in names}
    constexprs = {(names.index(a),): v for a, v in const.items()}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in floats + ints}
    for warps in (1, 4):
        compiled = triton.compile(ASTSource(kernel, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=warps))
        layouts = re.findall(r"#blocked\d* = .*", compiled.asm["ttgir"])
        ptx = compiled.asm["ptx"].split(".section\t.debug")[0]
        print(f"num_warps={warps}: layouts {layouts}; shfl.sync.bfly {len(re.findall(r'shfl.sync.bfly', ptx))}, "
              f"bar.sync {len(re.findall(r'bar.sync', ptx))}, add.f32 {len(re.findall(r'add.f32', ptx))}")


if __name__ == "__main__":
    main()
