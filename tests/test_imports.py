"""The import graph of mok, rl and verify, read with `ast` (module-level and function-level imports):
no cycles, imports go downward (mok knows neither rl nor verify; verify knows neither mok nor rl), only
rl/vllm/vllm_internals.py (and its MLA part, vllm_internals_mla.py) reaches into vLLM's submodules, and no test
imports examples/.

    python tests/test_imports.py      # prints the graph (module -> the modules it imports)
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mok", "rl", "verify")
VLLM_INTERNALS = {"rl.vllm.vllm_internals", "rl.vllm.vllm_internals_mla"}
VLLM_PUBLIC = {"vllm", "vllm.LLM", "vllm.SamplingParams"}
"""What any module may import from vLLM: the package (its version) and the two classes users call."""


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for package in PACKAGES for p in sorted((root / package).rglob("*.py"))}


def imported_names(path: Path, name: str) -> list[str]:
    """Every name `path` imports, anywhere in the file: 'a.b' for `import a.b`, 'a.b.c' for
    `from a.b import c` (relative imports resolved against module `name`)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parent, base] if base else parent)
            out += [f"{base}.{alias.name}" if alias.name != "*" else base for alias in node.names]
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules of PACKAGES it imports (`from pkg import name` counts as importing the
    submodule pkg.name when there is one, else pkg itself)."""
    modules = _modules(root)
    graph = {}
    for name, path in modules.items():
        edges = set()
        for imported in imported_names(path, name):
            if imported.split(".")[0] not in PACKAGES:
                continue
            while imported not in modules and "." in imported:
                imported = imported.rpartition(".")[0]
            if imported in modules and imported != name:
                edges.add(imported)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (a path that returns to its start), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _top(name: str) -> str:
    return name.split(".")[0]


def test_the_graph_is_read():
    graph = import_graph()
    assert {"mok", "rl", "verify", "rl.vllm.plugin", "verify.report"} <= set(graph)
    assert "rl.trace_names" in graph["rl.models.decoder"]
    assert "rl.vllm.vllm_internals" in graph["rl.vllm.routing"]  # a function-level import counts


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_imports_go_downward():
    graph = import_graph()
    upward = sorted((module, target) for module, targets in graph.items() for target in targets
                    if (_top(module) == "mok" and _top(target) in ("rl", "verify"))
                    or (_top(module) == "verify" and _top(target) in ("mok", "rl")))
    assert not upward, upward


def test_only_vllm_internals_reaches_into_vllm():
    offenders = sorted((name, imported) for name, path in _modules().items() if name not in VLLM_INTERNALS
                       for imported in imported_names(path, name)
                       if _top(imported) == "vllm" and imported not in VLLM_PUBLIC)
    assert not offenders, offenders


def test_tests_do_not_import_examples():
    offenders = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("*.py")
                       if any(_top(name) == "examples" for name in imported_names(path, module_name(path))))
    assert not offenders, offenders


if __name__ == "__main__":
    for module, targets in sorted(import_graph().items()):
        print(f"{module} -> {', '.join(sorted(targets)) or '-'}")
    cycle = find_cycle(import_graph())
    print("cycle: " + (" -> ".join(cycle) if cycle else "none"))
    sys.exit(1 if cycle else 0)
