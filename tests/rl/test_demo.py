"""The main job (examples/rl_demo.py): a short RL run is bitwise trainer == sampler at every step,
reproducible (identical trace digests and checkpoint, also from another process), writes real PNG/HTML
files; the --baseline run shows a real gap and where it starts; the bisect walkthrough names the
commit and the op.

Tests never import examples/: the demo runs as a program (`python -m examples.rl_demo`), and its
pieces (rewards, prompts, advantages, loss) are checked by short scripts run in a fresh interpreter."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import verify
from rl import trace_names

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = ["--steps", "2", "--prompts", "2", "--group", "4", "--digits", "3", "--seed", "7"]


def _run(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=ENV)


def _cli(args: list[str], timeout: int = 300) -> tuple[int, list[dict]]:
    """`python -m examples.rl_demo ARGS --json` in a fresh process: (exit code, JSON lines)."""
    proc = _run(["-m", "examples.rl_demo", *args, "--json"], timeout)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stderr[-2000:]
    return proc.returncode, lines


def _check(script: str, timeout: int = 120) -> None:
    """Run `script` (asserts over the demo's functions) in a fresh interpreter at the repository root."""
    proc = _run(["-c", textwrap.dedent(script)], timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _steps_and_summary(lines: list[dict]) -> tuple[list[dict], dict]:
    (summary,) = [line for line in lines if line["event"] == "summary"]
    return [line for line in lines if line["event"] == "step"], summary


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """(steps, summary) of a short run with the rl.generate sampler, as the demo prints them with --json."""
    out = tmp_path_factory.mktemp("demo") / "a"
    code, lines = _cli([*SMALL, "--sampler", "mok", "--out", str(out)])
    assert code == 0, lines
    return _steps_and_summary(lines)


def test_copy_reward():
    _check("""
        import pytest
        from examples.demo_model import DIGITS, copy_position_rewards, copy_reward

        prompt = [1, DIGITS[3], DIGITS[5], 3]
        assert copy_reward(prompt, [DIGITS[3], DIGITS[5]]) == 1.0
        assert copy_reward(prompt, [DIGITS[3], DIGITS[6]]) == pytest.approx(0.55)
        assert copy_reward(prompt, [0, 2]) == 0.0
        assert copy_reward(prompt, [DIGITS[3]]) == 0.5
        assert copy_position_rewards(prompt, [DIGITS[3], DIGITS[6]]) == [1.0, 0.1]
        assert copy_position_rewards(prompt, [DIGITS[4], 2]) == [0.1, 0.0]
        # Equal outcomes at other positions give bit-identical rewards (a float sum in position order would
        # not: 1.0 + 0.1 + 0.1 != 0.1 + 0.1 + 1.0 in binary floating point).
        long = [1, DIGITS[1], DIGITS[2], DIGITS[3], 3]
        first, last = [DIGITS[1], DIGITS[0], DIGITS[0]], [DIGITS[0], DIGITS[0], DIGITS[3]]
        assert copy_reward(long, first) == copy_reward(long, last)
    """)


def test_copy_prompts_are_balanced():
    _check("""
        import torch
        from examples.demo_model import DIGITS, NUM_DIGITS, copy_prompts

        for count, length in [(10, 2), (23, 3), (4, 1)]:
            prompts = copy_prompts(count, length, torch.Generator().manual_seed(count))
            assert len(prompts) == count and all(p[0] == 1 and p[-1] == 3 and len(p) == length + 2 for p in prompts)
            for position in range(1, length + 1):
                column = [p[position] for p in prompts]
                assert set(column) <= set(DIGITS)
                counts = [column.count(d) for d in DIGITS]
                # ceil(count / 10) shuffled copies of the digits, cut to `count`: no digit twice ahead of another.
                assert max(counts) - min(counts) <= 1 and max(counts) == -(-count // NUM_DIGITS)
            assert copy_prompts(count, length, torch.Generator().manual_seed(count)) == prompts
    """)


def test_grpo_pieces():
    _check("""
        import torch
        from examples.rl_demo import group_advantages

        rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.2])
        adv = group_advantages(rewards, 2)
        assert adv[0] > 0 > adv[1] and adv[0] == -adv[1]
        assert torch.equal(adv[2:], torch.zeros(4))
        # Per position ([B, L]): each column is normalised within its group on its own.
        rewards_BL = torch.tensor([[1.0, 0.1], [0.1, 0.1], [0.0, 1.0], [0.0, 0.1]])
        adv_BL = group_advantages(rewards_BL, 2)
        centered = rewards_BL.reshape(2, 2, 2) - rewards_BL.reshape(2, 2, 2).mean(dim=1, keepdim=True)
        scale = rewards_BL.reshape(2, 2, 2).std(dim=1, keepdim=True, unbiased=False) + 1e-4
        expected = torch.where(centered != 0, centered / scale, torch.zeros_like(centered)).reshape(4, 2)
        assert torch.equal(adv_BL, expected) and adv_BL[0, 1] == 0 and adv_BL[2, 0] == 0 and adv_BL[2, 1] > 0
    """)


def test_equal_rewards_give_exactly_zero_advantages():
    """The fp32 mean of equal rewards can be an ulp off (0.1 x 8 -> every centred value -7.45e-9); the
    advantage must still be exactly 0, or AdamW turns that sliver into a full same-signed step."""
    _check("""
        import pytest
        import torch
        from examples.rl_demo import clipped_pg_loss, group_advantages

        for reward in [0.1, 0.175, 0.325, 0.775, 0.025]:
            for group in [8, 12, 5]:
                rewards = torch.tensor([reward] * group + [0.0, 1.0] * (group // 2) + [0.5] * (group % 2))
                adv = group_advantages(rewards, group)
                assert torch.equal(adv[:group], torch.zeros(group)), (reward, group)
                assert (adv[group:] != 0).sum() >= 2, (reward, group)
        old = torch.tensor([-1.0, -2.0, -0.5])
        new = old.clone().requires_grad_()
        loss = clipped_pg_loss(new, old, torch.tensor([1.0, -2.0, 0.5]), clip=0.2)
        assert loss.item() == pytest.approx(-(1.0 - 2.0 + 0.5) / 3)  # ratio 1: -mean(advantage)
        loss.backward()
        assert torch.allclose(new.grad, -torch.tensor([1.0, -2.0, 0.5]) / 3)
        # Outside the clip range the clipped side wins and the gradient is zero.
        far = (old + 1.0).requires_grad_()
        clipped_pg_loss(far, old, torch.tensor([1.0, 1.0, 1.0]), clip=0.2).backward()
        assert torch.equal(far.grad, torch.zeros(3))
    """)


def test_every_step_is_bitwise_trainer_equals_sampler(first_run):
    steps, summary = first_run
    assert [s["step"] for s in steps] == [0, 1]
    for s in steps:
        assert s["max_logprob_gap"] == 0.0
        assert s["bitwise_equal_tokens"] == s["tokens"] == 2 * 4 * 3
        assert s["routing_agreement"] == 1.0
        # 2 layers x 7 per-row ops + final_norm + lm_head
        assert s["ops_compared"] == 16 and s["ops_agreeing"] == 16
        assert s["first_divergence"] is None and 0.0 <= s["reward"] <= 1.0
    assert summary["bitwise"] is True and summary["first_divergence"] is None


def test_files_are_real_pngs_html_and_traces(first_run):
    _, summary = first_run
    out = Path(summary["out"])
    for png in ("metrics.png", "agreement.png"):
        assert (out / png).read_bytes()[:8] == PNG_MAGIC
    html = Path(summary["report"]).read_text()
    assert "<img src='metrics.png'" in html and "identical" in html
    trace = verify.Trace(out / "trainer.db")
    assert trace.meta["partner"] == "sampler.db" and len(trace.steps()) == 2
    assert trace.meta["aligned_ops"] == list(trace_names.per_row_globs(routes=True))
    names = {r.name for r in trace.records(step=0)}
    assert {"embed", "layers.1.moe", "layers.0.routes", "lm_head", "logprobs"} <= names
    assert any(r.kind == "param" for r in trace.records(step=1))  # gradients are recorded
    from verify.report import read_metrics

    assert [s for s, _ in read_metrics(out / "trainer.db")["max_logprob_gap"]] == [0, 1]
    # The report's heat map lists the ops in data-path order, routes right after the router.
    report = json.loads((out / "report.json").read_text())
    assert report["identical"] is True and report["comparison"] == "content"


def test_report_command_on_the_demo_trace_needs_no_options(first_run, tmp_path):
    """`mok-verify report trainer.db`: the trace names its partner and its per-row ops (metadata)."""
    _, summary = first_run
    proc = _run(["-m", "verify.cli", "report", str(Path(summary["out"]) / "trainer.db"), "--out", str(tmp_path)], 120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["identical"] is True and report["aligned_ops"] == list(trace_names.per_row_globs(routes=True))
    assert (tmp_path / "agreement.png").read_bytes()[:8] == PNG_MAGIC


def test_rerun_in_another_process_is_identical(first_run, tmp_path):
    first_steps, first = first_run
    code, lines = _cli([*SMALL, "--sampler", "mok", "--out", str(tmp_path / "b")])
    assert code == 0
    steps, summary = _steps_and_summary(lines)
    assert [s["digest"] for s in steps] == [s["digest"] for s in first_steps]
    assert summary["trace_digest"] == first["trace_digest"]
    assert summary["sampler_digest"] == first["sampler_digest"]
    assert summary["checkpoint_digest"] == first["checkpoint_digest"] and summary["bitwise"] is True
    result = verify.compare_checkpoints(first["checkpoint"], summary["checkpoint"], progress=False)
    assert result.identical
    assert verify.diff_traces(Path(first["out"]) / "trainer.db", tmp_path / "b" / "trainer.db").identical
    # The CLI says so too.
    cli = _run(["-m", "verify.cli", "checkpoint", first["checkpoint"], summary["checkpoint"]], 120)
    assert cli.returncode == 0 and cli.stdout.startswith("identical")


def test_another_seed_gives_other_digests(first_run, tmp_path):
    first_steps, _ = first_run
    code, lines = _cli([*SMALL[:-1], "8", "--steps", "1", "--sampler", "mok", "--out", str(tmp_path)])
    assert code == 0
    steps, _ = _steps_and_summary(lines)
    assert steps[0]["digest"] != first_steps[0]["digest"]
    assert steps[0]["max_logprob_gap"] == 0.0


def test_baseline_shows_a_gap_and_where_it_starts(tmp_path):
    proc = _run(["-m", "examples.rl_demo", "--steps", "1", *SMALL[2:], "--sampler", "mok", "--baseline",
                 "--out", str(tmp_path)], 300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = proc.stdout
    assert "where it starts" in text
    (step_line,) = [line for line in text.splitlines() if line.startswith("step   0")]
    gap = float(step_line.split("max|trainer-sampler| ")[1].split()[0])
    assert gap > 0
    # Content alignment: the embedding rows match, the first per-row op after them (layer 0's input norm)
    # already differs: transformers' RMSNorm multiplies by the weight in bf16, mok in fp32.
    assert "step 0, layers.0.input_norm:" in text
    from verify.report import agreement_by_step, first_content_divergence

    ops = agreement_by_step(tmp_path / "trainer.db", tmp_path / "sampler.db", trace_names.per_row_globs(routes=True))
    first = first_content_divergence(ops)
    assert first.name == "layers.0.input_norm" and first.matched > 0 and first.agreeing < first.matched
    assert (tmp_path / "agreement.png").read_bytes()[:8] == PNG_MAGIC


def test_bisect_walkthrough_names_the_commit_and_the_op():
    proc = _run(["-m", "examples.bisect_walkthrough"], 300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "first diverging revision:" in proc.stdout
    assert "combine: speed up the expert combine with a scatter-add" in proc.stdout  # the walkthrough's bad commit
    assert "first divergent op: 'combine'" in proc.stdout
    assert "-> the scatter-add commit, and the op it changed, found" in proc.stdout


@pytest.mark.vllm
def test_vllm_sampler_is_bitwise_after_weight_updates(tmp_path):
    """vLLM (in process, mok plugin) samples; the trainer's weights are pushed to it after every update,
    so step 1 (after one AdamW step) is bitwise too. One run: an engine start costs ~20 s here."""
    code, lines = _cli([*SMALL, "--sampler", "vllm", "--out", str(tmp_path)], timeout=500)
    assert code == 0
    steps, summary = _steps_and_summary(lines)
    assert [s["step"] for s in steps] == [0, 1]
    for s in steps:
        assert s["max_logprob_gap"] == 0.0 and s["bitwise_equal_tokens"] == s["tokens"] == 24
        assert s["routing_agreement"] == 1.0 and s["ops_agreeing"] == s["ops_compared"] == 16
    assert summary["sampler"] == "vllm+mok" and summary["bitwise"] is True
    assert (tmp_path / "agreement.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.gpu
def test_gpu_run_is_bitwise_and_reproducible(tmp_path):
    """The larger model on CUDA (Triton ops, rl.generate sampler): bitwise every step, identical reruns."""
    runs = []
    for name in ("a", "b"):
        code, lines = _cli([*SMALL, "--device", "cuda", "--sampler", "mok", "--out", str(tmp_path / name)], timeout=600)
        assert code == 0
        runs.append(_steps_and_summary(lines))
    (steps_a, a), (steps_b, b) = runs
    assert a["device"] == "cuda" and a["bitwise"] and b["bitwise"]
    assert all(s["max_logprob_gap"] == 0.0 and s["routing_agreement"] == 1.0 for s in steps_a)
    assert [s["digest"] for s in steps_a] == [s["digest"] for s in steps_b]
    assert a["trace_digest"] == b["trace_digest"] and a["checkpoint_digest"] == b["checkpoint_digest"]


@pytest.mark.parametrize("args, message", [
    (["--lr", "nan"], "--lr must be a finite number > 0"),
    (["--clip", "-1"], "--clip a finite number >= 0"),
    (["--out", "FILE"], "is a file, not a folder"),
])
def test_a_bad_demo_argument_is_refused_before_the_out_folder_is_touched(tmp_path, args, message):
    out = tmp_path / "out"
    out.mkdir()
    (out / "trainer.db").write_bytes(b"an earlier run's trace")
    (tmp_path / "FILE").write_text("not a folder")
    args = [str(tmp_path / "FILE") if a == "FILE" else a for a in args]
    proc = _run(["-m", "examples.rl_demo", "--steps", "1", *(["--out", str(out)] if "--out" not in args else []),
                 *args], timeout=120)
    assert proc.returncode == 2 and message in proc.stderr.splitlines()[-1], proc.stderr
    assert (out / "trainer.db").read_bytes() == b"an earlier run's trace"
