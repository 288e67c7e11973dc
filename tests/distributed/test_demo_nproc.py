"""`./run demo --nproc 2`: the demo's trainer on two CPU processes (FSDP2 + expert parallelism 2, gloo),
the sampler (vLLM with the mok plugin where installed, else rl.generate) in the launching process: every
step's trainer log-probabilities equal the sampler's bitwise, routing and per-row ops agree."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

from tests.distributed.harness import REPO


def test_demo_with_two_trainer_ranks_is_bitwise(tmp_path):
    sampler = "vllm" if importlib.util.find_spec("vllm") is not None else "mok"
    proc = subprocess.run([sys.executable, "-m", "examples.rl_demo", "--nproc", "2", "--steps", "2", "--json",
                           "--device", "cpu", "--sampler", sampler, "--out", str(tmp_path / "demo")],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    steps = [line for line in lines if line.get("event") == "step"]
    summary = next(line for line in lines if line.get("event") == "summary")
    assert len(steps) == 2 and summary["bitwise"]
    assert "FSDP2 + expert parallelism 2" in summary["trainer"]
    for step in steps:
        assert step["max_logprob_gap"] == 0 and step["bitwise_equal_tokens"] == step["tokens"] == 240
        assert step["routing_agreement"] == 1.0 and step["ops_agreeing"] == step["ops_compared"] > 0
    assert (tmp_path / "demo" / "checkpoint.safetensors").is_file()
