"""Negative control: leave one op to vLLM (MOK_VLLM_SKIP=rms_norm) and the trace diff must name it, from an
eager engine and from a compiled one (vLLM's torch.compile of the model, where the records go through the device
tap, verify/capture.py). With MOK_TRACE, a skipped op is still recorded under its trace name (vLLM computes, mok
observes), so content alignment finds the first op whose equal inputs give different outputs.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rl import trace_names

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.vllm

SKIPPED_OP = "rms_norm"
NORMS = (trace_names.INPUT_NORM, trace_names.POST_ATTENTION_NORM, trace_names.FINAL_NORM)
PER_ROW_OPS = trace_names.per_row_globs()


@pytest.fixture(scope="module", params=["eager", "compiled"])
def run(request, tmp_path_factory, restored_vllm_module):
    from rl.testing import save_tiny_checkpoint
    from rl.vllm import trace_files
    from rl.vllm.testing import (
        environment,
        generate,
        load_trainer,
        mixed_prompts,
        shutdown,
        start_engine,
        trainer_logprobs,
    )

    directory = tmp_path_factory.mktemp(f"vllm_negative_{request.param}")
    checkpoint = save_tiny_checkpoint("qwen3_moe", directory / "model", seed=0)
    sampler_trace = directory / "sampler.db"
    with environment(MOK_VLLM="1", MOK_VLLM_OPS=None, MOK_VLLM_SKIP=SKIPPED_OP, MOK_TRACE=str(sampler_trace)):
        llm = start_engine(checkpoint, max_num_seqs=16, compiled=request.param == "compiled")
        try:
            samples = generate(llm, mixed_prompts([4, 11, 23], seed=3), 4)
        finally:
            shutdown(llm)
    trainer_trace = directory / "trainer.db"
    trainer = trainer_logprobs(load_trainer(checkpoint), samples, trainer_trace)
    (sampler,) = trace_files(sampler_trace)
    names = [arg for pattern in PER_ROW_OPS for arg in ("--name", pattern)]
    diff = subprocess.run([sys.executable, "-m", "verify.cli", "diff", "--align", "content", "--json", *names,
                           str(sampler), str(trainer_trace)], cwd=ROOT, capture_output=True, text=True)
    return dict(samples=samples, trainer=trainer, diff=diff, mode=request.param)


def test_trace_diff_names_the_op_left_to_vllm(run):
    diff = run["diff"]
    assert diff.returncode == 1, diff.stdout + diff.stderr  # 1: diverged
    report = json.loads(diff.stdout)
    assert report["identical"] is False
    ops = report["ops"]  # in the sampler's execution order
    first_bad = next(op for op in ops if op["mismatched"] > 0)
    assert trace_names.split(first_bad["name"])[1] in NORMS  # the op left to vLLM
    if run["mode"] == "eager":  # the first RMSNorm, fed by the (exact) embedding
        assert first_bad["name"] == "layers.0.input_norm"
    # Compiled, inductor may round layer 0's plain norm as mok does on the CPU; then the first fused-add norm
    # diverges. The embedding's rows match.
    embed = next(op for op in ops if op["name"] == "embed")
    assert embed["mismatched"] == 0 and embed["matched"] > 0 and ops.index(embed) < ops.index(first_bad)


def test_logprobs_are_no_longer_bitwise_equal(run):
    from rl.vllm.testing import gaps

    sampled, prompt = gaps(run["samples"], run["trainer"])
    assert not torch.equal(torch.cat([sampled, prompt]), torch.zeros(sampled.numel() + prompt.numel()))
