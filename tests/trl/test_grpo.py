"""Issue 18: TRL's GRPOTrainer + vLLM (colocate, compiled: TRL sets no enforce_eager) with rl.trl, 3 steps
with weight sync, at temperatures 1.0 and 0.7 (with a reference model): TRL's own
`sampling/sampling_logp_difference/max` is exactly 0.0 at every step and its importance-sampling ratio
exactly 1.0; the negative control (the plugin's ops off in vLLM, `--sampler off`) shows the gap.

The runs are `python -m examples.trl_grpo --json` in fresh processes (tests never import examples/; a
colocated vLLM engine lives in its trainer's process). A gap of 0.0 at steps 2 and 3 also proves the
weight sync: the policy changed after step 1, so vLLM must sample from the updated weights to agree.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
for _key in ("MOK_VLLM", "MOK_VLLM_OPS", "MOK_VLLM_SKIP", "MOK_TRACE", "VLLM_PLUGINS"):
    ENV.pop(_key, None)
STEPS = 3

pytestmark = pytest.mark.vllm

_runs: dict[tuple[str, ...], tuple[list[dict], dict]] = {}


def run(tmp_path_factory, *args: str) -> tuple[list[dict], dict]:
    """(step records, summary) of `python -m examples.trl_grpo --steps 3 --json ARGS`, once per ARGS."""
    if args not in _runs:
        out = tmp_path_factory.mktemp("trl_grpo")
        proc = subprocess.run([sys.executable, "-m", "examples.trl_grpo", "--steps", str(STEPS), "--json",
                               "--out", str(out), *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                              timeout=600)
        lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"event"')]
        assert proc.returncode == 0 and lines, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        steps = [line for line in lines if line["event"] == "step"]
        (summary,) = [line for line in lines if line["event"] == "summary"]
        _runs[args] = (steps, summary)
    return _runs[args]


# 0.7: the checkpoint path is given to TRL (it loads the policy, dtype "auto") and beta > 0 adds TRL's
# reference model, whose log-probabilities go through the same override.
RUNS = {"1.0": (), "0.7": ("--model-path", "--beta", "0.04")}


@pytest.mark.parametrize("temperature", sorted(RUNS, reverse=True))
def test_trl_gap_is_exactly_zero_at_every_step(tmp_path_factory, temperature):
    steps, summary = run(tmp_path_factory, "--temperature", temperature, *RUNS[temperature])
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    for s in steps:
        assert s["sampling/sampling_logp_difference/max"] == 0.0, s
        assert s["sampling/sampling_logp_difference/mean"] == 0.0, s
        for stat in ("min", "mean", "max"):
            assert s[f"sampling/importance_sampling_ratio/{stat}"] == 1.0, s
        assert s["num_tokens"] > 0 and s["completions/mean_length"] > 0
        assert ("kl" in s) == (temperature == "0.7")  # TRL logs the KL to the reference model when beta > 0
    # real training with weight sync: the policy moved, and vLLM (synced before each generation) agreed
    assert summary["weights_changed"] > 0
    assert summary["gaps"] == [0.0] * STEPS and summary["temperature"] == float(temperature)
    assert summary["wrapped"] is True  # the policy computes through rl.wrap's forward, not TRL's fused head
    assert {"logprobs", "moe", "attention", "lm_head"} <= set(summary["vllm_plugin_ops"])


def test_negative_control_without_the_plugin_shows_the_gap(tmp_path_factory):
    steps, summary = run(tmp_path_factory, "--sampler", "off")
    assert summary["vllm_plugin_ops"] == ["linear", "moe"]  # everything else is vLLM's own
    assert len(steps) == STEPS
    for s in steps:
        assert s["sampling/sampling_logp_difference/max"] > 1e-4, s
        assert s["sampling/importance_sampling_ratio/min"] != 1.0 or s["sampling/importance_sampling_ratio/max"] != 1.0
