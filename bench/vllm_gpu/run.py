"""vLLM 0.26.0 + mok on a CUDA GPU, CUDA graphs on: the trainer == sampler proof, the cost against stock
vLLM in the same run, and where the time goes.

Usage on the H200 machine, from the repository root, after the bundle (bench/vllm_gpu/bundle.sh) is
unpacked into /tmp/site (docs/development.md, "The H200 vLLM bundle"):

    PYTHONPATH=/tmp/site:. python bench/vllm_gpu/run.py --out $OUT [--models qwen3-30b-a3b-4l,mixtral-2l]
        [--phases build,proof,speed,negative] [--deadline SECONDS]
    PYTHONPATH=/tmp/site:. python bench/vllm_gpu/run.py --matrix --out $OUT [--archs olmoe,qwen2_moe]
        [--diagnose qwen2_moe]      # the conformance matrix (bench/vllm_gpu/matrix.py)
    PYTHONPATH=/tmp/site:. python bench/vllm_gpu/run.py --full-depth --out $OUT [--speed-models qwen3-30b-a3b]
                                    # tokens/s at full depth: mok, stock, stock batch-invariant (speed.py)

Each engine runs in its own child process (the GPU is released between them) with the engine in that
process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the same for mok and stock), so torch.profiler sees the kernels
vLLM replays from its CUDA graphs. Phases per model:
- build: random bf16 weights saved as safetensors (rl.testing.save_tiny_checkpoint on the GPU).
- proof: vLLM + mok (MOK_VLLM=1, all ops) with max_num_seqs 1 and 128, chunked prefill, prompts of 1 to
  2000 tokens, 64 sampled tokens each, temperature 1, one seed per request; then rl.logprobs over the same
  tokens; counts of bitwise-equal sampled and prompt log-probabilities.
- speed: tokens/s of vLLM + mok and stock vLLM (no plugin; vLLM picks its attention and MoE backends, named
  in the output) at batch 1, 64 and 256, 512 output tokens, sampled log-probabilities on; then a profiled
  generation (kernel time by name) for each.
- negative: MOK_VLLM_SKIP=rms_norm with MOK_TRACE (eager: hooks record only outside CUDA graphs), the trainer
  traced on the same tokens, `mok-verify diff` names the first diverging op.
Writes $OUT/<model>/<phase>*.json, $OUT/vllm-gpu-latest.json (the summary) and prints one line per step.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

MODELS = {
    # Qwen3-30B-A3B's shapes, 4 layers
    "qwen3-30b-a3b-4l": dict(arch="qwen3_moe", hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                             head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                             intermediate_size=6144, vocab_size=151936, num_hidden_layers=4),
    # Mixtral-8x7B's shapes, 2 layers
    "mixtral-2l": dict(arch="mixtral", hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       num_local_experts=8, num_experts_per_tok=2, intermediate_size=14336, vocab_size=32000,
                       num_hidden_layers=2),
}
COMMON = dict(max_position_embeddings=4096, initializer_range=0.02)
MAX_MODEL_LEN = 4096
CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
PROOF_SEQS = (1, 128)
PROOF_TOKENS = 64
SPEED_BATCHES = (1, 64, 256)
SPEED_TOKENS = 512
ENV = dict(VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1",
           TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false")


def log(message: str) -> None:
    print(f"[vllm-gpu {time.strftime('%H:%M:%S')}] {message}", flush=True)


# -- child-process work -----------------------------------------------------------------------------------

def prompts(count: int, vocab: int, seed: int, lengths: list[int] | None = None) -> list[list[int]]:
    """Token-id prompts: the given lengths, else `count` lengths log-uniform in 1..2000 (1 and 2000 included)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    if lengths is None:
        drawn = torch.exp(torch.rand(count, generator=generator) * torch.log(torch.tensor(2000.0))).long()
        lengths = [1, 2000, *drawn.clamp(1, 2000).tolist()][:count]
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def engine(model_dir: str, max_num_seqs: int, eager: bool = False):
    from vllm import LLM

    return LLM(model=model_dir, dtype="bfloat16", skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN,
               max_num_seqs=max_num_seqs, enable_chunked_prefill=True, max_num_batched_tokens=2048,
               enable_prefix_caching=False, gpu_memory_utilization=0.6, seed=0, enforce_eager=eager,
               compilation_config=None if eager else {"cudagraph_capture_sizes": CAPTURE_SIZES})


def engine_facts(llm) -> dict:
    import vllm

    from rl.vllm import plugin

    config = llm.llm_engine.vllm_config
    return dict(vllm_version=vllm.__version__, cudagraph_mode=str(config.compilation_config.cudagraph_mode),
                enforce_eager=bool(config.model_config.enforce_eager),
                custom_ops=list(config.compilation_config.custom_ops),
                model_runner="v2" if getattr(config, "use_v2_model_runner", False) else "v1",
                mok_ops=sorted(plugin.registered_ops() or []))


def child_build(name: str, out: Path) -> dict:
    import torch

    from rl.testing import save_tiny_checkpoint

    spec = dict(MODELS[name])
    arch = spec.pop("arch")
    start = time.time()
    save_tiny_checkpoint(arch, out, seed=0, device="cuda", **COMMON, **spec)
    torch.cuda.synchronize()
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    return dict(model=name, seconds=round(time.time() - start, 1), safetensors_bytes=size)


def child_sample(model_dir: str, max_num_seqs: int, lengths: list[int] | None, count: int, eager: bool,
                 out: Path) -> dict:
    from rl.vllm.testing import generate

    vocab = json.loads(Path(model_dir, "config.json").read_text())["vocab_size"]
    llm = engine(model_dir, max_num_seqs, eager=eager)
    samples = generate(llm, prompts(count, vocab, seed=max_num_seqs, lengths=lengths), PROOF_TOKENS, seed=0,
                       temperature=1.0)
    out.write_text(json.dumps([s.__dict__ for s in samples]))
    return dict(engine_facts(llm), requests=len(samples), prompt_tokens=sum(len(s.prompt) for s in samples),
                sampled_tokens=sum(len(s.completion) for s in samples))


def child_compare(model_dir: str, sample_files: list[str], trace: str | None) -> dict:
    import torch
    import transformers

    import rl
    from rl.vllm.testing import Sample, gaps, trainer_logprobs

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda")
    model = rl.wrap(model.eval())
    result = {}
    for path in sample_files:
        samples = [Sample(**s) for s in json.loads(Path(path).read_text())]
        trainer = [lp.cpu() for lp in trainer_logprobs(model, samples, trace)]
        sampled, prompt = gaps(samples, trainer)
        both = torch.cat([sampled, prompt])
        result[Path(path).stem] = dict(
            equal=int((both == 0).sum()), total=both.numel(),
            sampled_equal=int((sampled == 0).sum()), sampled_total=sampled.numel(),
            prompt_equal=int((prompt == 0).sum()), prompt_total=prompt.numel(),
            max_gap=float(both.abs().max()) if both.numel() else 0.0)
    return result


def child_speed(model_dir: str, out: Path) -> dict:
    import torch
    from vllm import SamplingParams

    vocab = json.loads(Path(model_dir, "config.json").read_text())["vocab_size"]
    llm = engine(model_dir, max(SPEED_BATCHES))

    def run(batch: int, tokens: int, seed: int) -> float:
        params = [SamplingParams(max_tokens=tokens, temperature=1.0, seed=seed + i, logprobs=0, detokenize=False,
                                 ignore_eos=True) for i in range(batch)]
        requests = [{"prompt_token_ids": p} for p in prompts(batch, vocab, seed, lengths=[128] * batch)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=False)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == tokens for o in outputs)
        return seconds

    run(8, 16, seed=99)  # warm-up
    result = dict(engine_facts(llm), batches={})
    for batch in SPEED_BATCHES:
        seconds = min(run(batch, SPEED_TOKENS, seed=s) for s in (1, 2))
        result["batches"][str(batch)] = dict(seconds=round(seconds, 4), tokens_per_s=round(batch * SPEED_TOKENS
                                                                                            / seconds, 1))
        log(f"  batch {batch}: {result['batches'][str(batch)]}")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as profiler:
        run(64, 64, seed=7)
    kernels = [e for e in profiler.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in kernels) or 1.0
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:30]
    result["profile_batch64_64tokens"] = dict(
        gpu_ms=round(total / 1000, 3),
        kernels=[dict(name=e.key[:160], calls=e.count, ms=round(e.self_device_time_total / 1000, 3),
                      share=round(e.self_device_time_total / total, 4)) for e in top])
    out.write_text(json.dumps(result, indent=1))
    return result


def child_main(args) -> None:
    from bench.vllm_gpu import matrix, speed

    kind, payload = args.child, json.loads(args.payload)
    result = {"full-depth": lambda: speed.child_full_depth(payload["model_dir"], payload["engine"], payload["out"],
                                                           payload.get("tiny", False)),
              "matrix-build": lambda: matrix.child_build(payload["arch"], payload["out"], payload["tiny"]),
              "matrix-cell": lambda: matrix.child_cell(payload["model_dir"], payload["setting"], payload["out"],
                                                       payload["tiny"]),
              "matrix-compare": lambda: matrix.child_compare(payload["arch"], payload["model_dir"], payload["cells"],
                                                             payload.get("trace")),
              "build": lambda: child_build(payload["model"], Path(payload["out"])),
              "sample": lambda: child_sample(payload["model_dir"], payload["max_num_seqs"], payload.get("lengths"),
                                             payload["count"], payload.get("eager", False), Path(payload["out"])),
              "compare": lambda: child_compare(payload["model_dir"], payload["files"], payload.get("trace")),
              "speed": lambda: child_speed(payload["model_dir"], Path(payload["out"]))}[kind]()
    print("RESULT " + json.dumps(result), flush=True)


# -- the driver ---------------------------------------------------------------------------------------------

def child(kind: str, payload: dict, env: dict, log_file: Path, timeout: float) -> dict | None:
    """Run one child; its output goes to log_file; returns its RESULT or None (failure: the log says why)."""
    full_env = {**os.environ, **ENV, **env}
    for key in [k for k, v in full_env.items() if v is None]:
        full_env.pop(key)
    command = [sys.executable, __file__, "--child", kind, "--payload", json.dumps(payload)]
    start = time.time()
    try:
        done = subprocess.run(command, env=full_env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as expired:
        output = (expired.stdout or b"").decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        code = "timeout"
    log_file.write_text(output)
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    log(f"{kind} {log_file.name}: exit {code} in {time.time() - start:.0f} s")
    if not lines:
        tail = [line for line in output.splitlines() if line.strip()][-12:]
        log("  failed; last lines:\n    " + "\n    ".join(tail))
        return None
    return json.loads(lines[-1][len("RESULT "):])


def build_parser() -> argparse.ArgumentParser:
    from rl.models import VLLM_SUPPORTED

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/vllm-gpu")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--phases", default="build,proof,speed,negative")
    parser.add_argument("--deadline", type=float, default=540.0, help="seconds; later phases are skipped")
    parser.add_argument("--work", default="/tmp/mok-vllm-gpu", help="checkpoints and samples")
    parser.add_argument("--matrix", action="store_true", help="the conformance matrix instead of --phases")
    parser.add_argument("--archs", default=",".join(VLLM_SUPPORTED), help="--matrix: architectures")
    parser.add_argument("--settings", default="",
                        help="--matrix: only these settings (names in rl/vllm/conformance.py); default every one")
    parser.add_argument("--diagnose", default="",
                        help="--matrix: architectures that also get a traced CUDA-graph engine")
    parser.add_argument("--full-depth", action="store_true", help="the sampler's speed at full depth (speed.py)")
    parser.add_argument("--speed-models", default="qwen3-30b-a3b,mixtral-8x7b", help="--full-depth: models")
    parser.add_argument("--speed-engines", default="mok,stock,batch_invariant",
                        help="--full-depth: engines (add mok_traced for the cost of tracing)")
    parser.add_argument("--trace-names", default=None,
                        help="--full-depth: MOK_TRACE_NAMES of mok_traced (default: every name)")
    parser.add_argument("--tiny", action="store_true", help="--matrix, --full-depth: tiny models (a CPU smoke run)")
    parser.add_argument("--child")
    parser.add_argument("--payload")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.child:
        return child_main(args)
    started = time.time()
    out, work = Path(args.out), Path(args.work)
    phases = args.phases.split(",")
    summary_path = out / "vllm-gpu-latest.json"
    # the summary grows across calls on one machine (work) and keeps the committed file's other entries
    kept = work / "vllm-gpu-latest.json"
    base = next((p for p in (summary_path, kept, ROOT / "bench/results/vllm-gpu-latest.json") if p.exists()), None)
    summary = json.loads(base.read_text()) if base is not None else {}
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    summary.setdefault("models", {})
    mok_env = dict(MOK_VLLM="1", MOK_VLLM_OPS=None, MOK_VLLM_SKIP=None, MOK_TRACE=None)
    stock_env = dict(MOK_VLLM=None, MOK_TRACE=None)

    def left() -> float:
        return args.deadline - (time.time() - started)

    def save() -> None:
        summary_path.write_text(json.dumps(summary, indent=1))
        kept.write_text(json.dumps(summary, indent=1))

    if args.full_depth:
        from bench.vllm_gpu import speed

        def speed_child(kind, payload, env, log_file, timeout):
            return child(kind, dict(payload, tiny=args.tiny), env, log_file, timeout)

        speed.run_full_depth(args, speed_child, summary, save, left)
        save()
        log(f"full depth done in {time.time() - started:.0f} s -> {summary_path}")
        return
    if args.matrix:
        from bench.vllm_gpu import matrix

        def matrix_child(kind, payload, env, log_file, timeout):
            return child(f"matrix-{kind}", payload, env, log_file, timeout)

        matrix.run_matrix(args, matrix_child, summary, save, left)
        summary["vllm_version"] = summary.get("vllm_version")
        save()
        log(f"matrix done in {time.time() - started:.0f} s -> {summary_path}")
        return

    for name in args.models.split(","):
        model_dir, model_out = work / name, out / name
        model_out.mkdir(parents=True, exist_ok=True)
        entry = summary["models"].setdefault(name, {})
        if "build" in phases and not (model_dir / "config.json").exists():
            entry["build"] = child("build", dict(model=name, out=str(model_dir)), {}, model_out / "build.log", left())
        if "proof" in phases and left() > 120:
            files = []
            for seqs in PROOF_SEQS:
                lengths = [1, 2, 17, 64, 65, 300, 1000, 2000] if seqs == 1 else None
                path = work / f"{name}-samples-seqs{seqs}.json"
                if path.exists():  # sampled by an earlier call on this machine (its facts are in that output)
                    files.append(str(path))
                    continue
                facts = child("sample", dict(model_dir=str(model_dir), max_num_seqs=seqs, lengths=lengths,
                                             count=8 if seqs == 1 else seqs, out=str(path)), mok_env,
                              model_out / f"sample-seqs{seqs}.log", left())
                if facts is not None:
                    entry[f"sampler_seqs{seqs}"] = facts
                    files.append(str(path))
            if files:
                compared = child("compare", dict(model_dir=str(model_dir), files=files), {},
                                 model_out / "compare.log", left())
                if compared is not None:
                    entry["proof"] = compared
                    entry["equal"] = sum(c["equal"] for c in compared.values())
                    entry["total"] = sum(c["total"] for c in compared.values())
                    log(f"{name}: {entry['equal']} / {entry['total']} log-probabilities bitwise equal")
            save()
        if "speed" in phases and left() > 150:
            speeds = {}
            for mode, env in (("mok", mok_env), ("stock", stock_env)):
                speeds[mode] = child("speed", dict(model_dir=str(model_dir), out=str(model_out / f"speed-{mode}.json")),
                                     env, model_out / f"speed-{mode}.log", left())
            if speeds["mok"] and speeds["stock"]:
                entry["speed"] = {batch: dict(mok_tokens_per_s=speeds["mok"]["batches"][batch]["tokens_per_s"],
                                              stock_tokens_per_s=speeds["stock"]["batches"][batch]["tokens_per_s"],
                                              ratio=round(speeds["mok"]["batches"][batch]["tokens_per_s"]
                                                          / speeds["stock"]["batches"][batch]["tokens_per_s"], 3))
                                  for batch in speeds["mok"]["batches"]}
                entry["speed_engines"] = {mode: {k: v for k, v in s.items() if k not in ("batches",
                                                                                         "profile_batch64_64tokens")}
                                          for mode, s in speeds.items()}
                log(f"{name}: speed {entry['speed']}")
            save()
        if "negative" in phases and left() > 90:
            path, trace = work / f"{name}-samples-negative.json", work / f"{name}-sampler-trace"
            env = dict(mok_env, MOK_VLLM_SKIP="rms_norm", MOK_TRACE=str(trace))
            facts = child("sample", dict(model_dir=str(model_dir), max_num_seqs=4, lengths=[5, 40, 300], count=3,
                                         eager=True, out=str(path)), env, model_out / "negative-sample.log", left())
            trainer_trace = work / f"{name}-trainer-trace.db"
            compared = child("compare", dict(model_dir=str(model_dir), files=[str(path)], trace=str(trainer_trace)),
                             {}, model_out / "negative-compare.log", left()) if facts else None
            traces = sorted(str(p) for p in work.glob(f"{name}-sampler-trace*.db"))
            if compared and traces:
                from rl import trace_names

                names = [arg for pattern in trace_names.per_row_globs() for arg in ("--name", pattern)]
                diff = subprocess.run([sys.executable, "-m", "verify.cli", "diff", "--align", "content", "--json",
                                       *names, traces[0], str(trainer_trace)], cwd=ROOT, capture_output=True,
                                      text=True)
                report = json.loads(diff.stdout) if diff.stdout.strip().startswith("{") else {}
                first = next((op["name"] for op in report.get("ops", []) if op.get("mismatched")), None)
                entry["negative_control"] = dict(skip="rms_norm", mode="eager (MOK_TRACE)",
                                                 **next(iter(compared.values())), first_diverging_op=first,
                                                 diff_exit=diff.returncode)
                (model_out / "negative-diff.json").write_text(diff.stdout or diff.stderr)
                log(f"{name}: negative control {entry['negative_control']}")
            save()
    import_version = next((e.get("sampler_seqs1", {}).get("vllm_version") for e in summary["models"].values()
                           if e.get("sampler_seqs1")), None)
    summary["vllm_version"] = import_version or summary.get("vllm_version")
    summary["cuda_graphs"] = any("FULL" in e.get("sampler_seqs128", {}).get("cudagraph_mode", "")
                                 for e in summary["models"].values())
    save()
    log(f"done in {time.time() - started:.0f} s -> {summary_path}")


if __name__ == "__main__":
    main()
