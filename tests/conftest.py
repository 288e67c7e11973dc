import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.interpret import parse_verdicts

REPO = Path(__file__).resolve().parents[1]

# tests/verl runs in verl's own environment (./run test: .venv-verl); elsewhere verl is absent.
collect_ignore = [] if importlib.util.find_spec("verl") else ["verl"]


def pytest_collection_modifyitems(config, items):
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    has_vllm = importlib.util.find_spec("vllm") is not None
    for item in items:
        if "gpu" in item.keywords and n_gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "vllm" in item.keywords and not has_vllm:
            item.add_marker(pytest.mark.skip(reason="vllm is not installed"))


class TritonInterpreter:
    """Runs Python files in a fresh process with TRITON_INTERPRET=1 and PYTHONPATH=repo:repo/tests.

    `run(script, *args)` -> CompletedProcess. `verdicts(script)` runs a file of interpreter cases
    (tests/helpers/interpret.py: Cases + run_cases) once per session and returns {case: "ok" or traceback}.
    """

    def __init__(self):
        self._verdicts: dict[str, dict[str, str]] = {}

    def run(self, script, *args, timeout: float = 900) -> subprocess.CompletedProcess:
        env = dict(os.environ, TRITON_INTERPRET="1")
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")])
        return subprocess.run([sys.executable, str(script), *map(str, args)], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=timeout)

    __call__ = run

    def verdicts(self, script) -> dict[str, str]:
        key = str(Path(script).resolve())
        if key not in self._verdicts:
            proc = self.run(key)
            verdicts = parse_verdicts(proc.stdout)
            assert proc.returncode in (0, 1) and verdicts is not None, (
                f"interpreter child {key} failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
            self._verdicts[key] = verdicts
        return self._verdicts[key]


@pytest.fixture(scope="session")
def triton_interpret() -> TritonInterpreter:
    """The one Triton-interpreter harness: see TritonInterpreter (parent side) and tests/helpers/interpret.py
    (child side)."""
    pytest.importorskip("triton")
    return TritonInterpreter()
