"""The child side of the Triton-interpreter harness (the parent side: the `triton_interpret` fixture in
tests/conftest.py).

TRITON_INTERPRET=1 must be set before triton is first imported, and must not leak into other tests (on a
GPU machine it would turn real kernels into interpreted ones), so interpreter cases run in a child
process: a test file (or helper) registers its cases in a `Cases` and ends with
`if __name__ == "__main__": sys.exit(run_cases(CASES))`. The child runs every case and prints, as its
last line, VERDICTS_MARKER followed by one JSON object {case name: "ok" or the case's traceback}; it
exits 0 when every case passed, 1 otherwise. The parent runs the file once and checks each case's verdict.
"""
from __future__ import annotations

import functools
import json
import os
import sys
import traceback
from collections.abc import Callable

VERDICTS_MARKER = "INTERPRETER-VERDICTS "


class Cases(dict):
    """Named cases (functions without arguments) of one interpreter file, in registration order."""

    def case(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Decorator: register fn under its own name."""
        return self.add(fn.__name__, fn)

    def add(self, name: str, fn: Callable[[], None]) -> Callable[[], None]:
        if name in self:
            raise ValueError(f"duplicate interpreter case {name!r}")
        self[name] = fn
        return fn

    def parametrize(self, fn: Callable[..., None], **axes: list) -> Callable[..., None]:
        """Register fn once per combination of the axes' values, named like pytest's parametrized ids."""
        combos = [{}]
        for axis, values in axes.items():
            combos = [dict(c, **{axis: v}) for c in combos for v in values]
        for combo in combos:
            label = "-".join("-".join(map(str, v)) if isinstance(v, tuple) else str(v).removeprefix("torch.")
                             for v in combo.values())
            self.add(f"{fn.__name__}[{label}]", functools.partial(fn, **combo))
        return fn


def run_cases(cases: Cases) -> int:
    """Run every case (each failure reported, not just the first) and print the verdicts line."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 set when the process starts (tests/conftest.py: triton_interpret)")
    verdicts = {}
    for name, fn in cases.items():
        try:
            fn()
            verdicts[name] = "ok"
        except Exception:
            verdicts[name] = traceback.format_exc()
    print(VERDICTS_MARKER + json.dumps(verdicts), flush=True)
    return 0 if all(v == "ok" for v in verdicts.values()) else 1


def parse_verdicts(stdout: str) -> dict[str, str] | None:
    """The verdicts a child printed, or None when it printed none."""
    lines = [line for line in stdout.splitlines() if line.startswith(VERDICTS_MARKER)]
    return json.loads(lines[-1][len(VERDICTS_MARKER):]) if lines else None


def interpreter_test(cases: Cases, file: str):
    """The pytest side of an interpreter file (`test_x = interpreter_test(CASES, __file__)`): one test per case,
    passing when the child's verdict for it is "ok"; otherwise the case's traceback is the failure message."""
    import pytest

    @pytest.mark.parametrize("name", sorted(cases))
    def test(triton_interpret, name):
        verdict = triton_interpret.verdicts(file).get(name, "case did not run")
        assert verdict == "ok", verdict

    return test
