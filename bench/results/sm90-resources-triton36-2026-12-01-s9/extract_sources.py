import ast, sys
out = ["import triton", "import triton.language as tl", ""]
def grab(path, names=None, consts=False):
    src = open(path).read()
    tree = ast.parse(src)
    lines = src.splitlines()
    for node in tree.body:
        if consts and isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) and t.id.isupper() for t in node.targets):
            seg = ast.get_source_segment(src, node)
            if "tl.constexpr" in seg or seg.split("=")[1].strip().lstrip("-").isdigit():
                out.append(seg)
        if isinstance(node, ast.FunctionDef) and any(ast.get_source_segment(src, d).startswith("triton.jit") for d in node.decorator_list):
            if names and node.name not in names: continue
            start = node.lineno - 1
            body = "\n".join(lines[start: node.end_lineno])
            out.append("@triton.jit\n" + body + "\n")
grab("mok/kernels/launch.py", {"wait_for_predecessor"})
grab("mok/kernels/moe/schedule.py", {"valid_ids"})
grab("mok/kernels/moe/grouped_gemm.py", consts=True)
open(sys.argv[1], "w").write("\n".join(out) + "\n")
