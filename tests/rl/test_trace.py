"""Both sides recorded with verify's Recorder (through mok.hooks): content alignment finds no
divergence between trainer (rl.logprobs) and sampler (rl.generate), and with one op of the trainer
switched to plain torch it names that op as the first divergence."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mok
import rl
from mok import hooks
from rl import trace_names
from rl.testing import tiny_model

verify = pytest.importorskip("verify")

# Attention is not a per-row op: at layer 0 a query row depends only on (token, position), so equal
# query rows from different prompts see different keys. Content alignment covers the per-row ops.
PER_ROW_OPS = list(trace_names.per_row_globs())
PROMPTS = 12
MAX_NEW_TOKENS = 4
SWITCHED = "layers.1.post_attention_norm"


def _record(path: Path, run: str, fn):
    with verify.Recorder(path, run=run) as recorder:
        with hooks.observe(lambda name, tensor, kind: recorder.record(name, tensor, kind=kind)):
            result = fn()
        recorder.step(param_grads=False)
    return result


@pytest.fixture(scope="module")
def sampler_trace(tmp_path_factory):
    model = rl.wrap(tiny_model("qwen3_moe", seed=21))
    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 11, (PROMPTS,), generator=generator).tolist()
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in lengths]
    path = tmp_path_factory.mktemp("traces") / "sampler.db"
    generation = _record(path, "sampler", lambda: rl.generate(model, prompts, MAX_NEW_TOKENS, seed=5, batch_size=8))
    return model, generation, path


def _trainer_trace(model, generation, path):
    input_ids, attention_mask, completion_mask = generation.padded(left=True)
    logprobs = _record(path, "trainer", lambda: rl.logprobs(model, input_ids, attention_mask))
    return logprobs[completion_mask].detach()


def test_content_alignment_finds_no_divergence(sampler_trace, tmp_path):
    model, generation, sampler_path = sampler_trace
    trainer_path = tmp_path / "trainer.db"
    trainer = _trainer_trace(model, generation, trainer_path)
    assert torch.equal(trainer, torch.cat(generation.logprobs))

    result = verify.align_by_content(trainer_path, sampler_path, names=PER_ROW_OPS)
    assert result.identical, result.describe()
    aligned = {op.name for op in result.ops}
    assert {"layers.0.moe", "layers.1.o_proj", "lm_head", "final_norm"} <= aligned
    for op in result.ops:
        # Every row the sampler computed was also computed, with the same bits, by the trainer.
        assert op.matched > 0 and op.mismatched == 0 and op.only_b == 0, op


def _plain_torch_for(target: str):
    """mok.rms_norm, except that the op named `target` runs transformers' eager RMSNorm in plain torch
    (torch.rsqrt, rounding to bf16 before the weight multiply). torch.nn.functional.linear is no good
    as the switched op here: on this CPU its bf16 results equal mok.linear's at these sizes."""
    original = mok.rms_norm

    def rms_norm(x, weight, eps, residual=None, *, name=None):
        if name != target:
            return original(x, weight, eps, residual, name=name)
        if residual is not None:
            x = residual = x + residual
        if hooks.observed():
            hooks.emit(name, x, "input")  # the normalized row, as mok.rms_norm records it
        variance = x.float().pow(2).mean(-1, keepdim=True)
        out = weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)
        if hooks.observed():
            hooks.emit(name, out, "output")
        return out if residual is None else (out, residual)

    return rms_norm


def test_a_plain_torch_op_is_named_as_the_first_divergence(sampler_trace, tmp_path, monkeypatch):
    model, generation, sampler_path = sampler_trace
    trainer_path = tmp_path / "trainer_plain.db"
    monkeypatch.setattr(mok, "rms_norm", _plain_torch_for(SWITCHED))
    trainer = _trainer_trace(model, generation, trainer_path)
    assert not torch.equal(trainer, torch.cat(generation.logprobs))

    result = verify.align_by_content(trainer_path, sampler_path, names=PER_ROW_OPS)
    assert not result.identical
    assert result.first_mismatch.name == SWITCHED, result.describe()
    assert all(op.ok for op in result.ops if op.name.startswith("layers.0."))


def _cli(*args: str) -> subprocess.CompletedProcess:
    executable = shutil.which("mok-verify", path=os.path.dirname(sys.executable))
    command = [executable] if executable else [sys.executable, "-m", "verify.cli"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=120)


def test_mok_verify_diff_command_line(sampler_trace, tmp_path, monkeypatch):
    pytest.importorskip("verify.cli")
    model, generation, sampler_path = sampler_trace
    good, bad = tmp_path / "trainer.db", tmp_path / "trainer_plain.db"
    _trainer_trace(model, generation, good)
    with monkeypatch.context() as patch:
        patch.setattr(mok, "rms_norm", _plain_torch_for(SWITCHED))
        _trainer_trace(model, generation, bad)
    names = [arg for op in PER_ROW_OPS for arg in ("--name", op)]
    same = _cli("diff", str(good), str(sampler_path), "--align", "content", *names)
    assert same.returncode == 0, same.stdout + same.stderr
    differ = _cli("diff", str(bad), str(sampler_path), "--align", "content", *names)
    assert differ.returncode == 1, differ.stdout + differ.stderr
    assert SWITCHED in differ.stdout
