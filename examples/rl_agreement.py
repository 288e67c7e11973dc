"""Trainer == sampler with the reference sampler (no vLLM): sample with rl.generate, recompute with
rl.logprobs, compare bitwise, take one training step, and optionally record both sides.

    python -m examples.rl_agreement --arch qwen3_moe                 # CPU, tiny random model
    python -m examples.rl_agreement --trace out/                     # + traces for mok-verify diff
    PYTHONPATH=. python3 -m examples.rl_agreement --device cuda      # GPU (Triton ops)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from rl.testing import ARCHITECTURES


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="qwen3_moe", choices=ARCHITECTURES)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--trace", type=Path, help="directory for trainer.db and sampler.db")
    args = parser.parse_args()
    if args.prompts < 1 or args.max_new_tokens < 1:
        parser.error("--prompts and --max-new-tokens must be >= 1")
    if args.trace is not None and args.trace.exists() and not args.trace.is_dir():
        parser.error(f"--trace {args.trace} is a file, not a folder")
    try:
        torch.device(args.device)
    except RuntimeError as error:
        parser.error(f"--device {args.device}: {error}")

    import rl
    from mok import hooks
    from rl import trace_names
    from rl.testing import tiny_model

    model = rl.wrap(tiny_model(args.arch, seed=0, device=args.device))
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (int(n),), generator=generator).tolist()
               for n in torch.randint(1, 17, (args.prompts,), generator=generator)]

    def recorded(name, fn):
        if args.trace is None:
            return fn()
        import verify

        args.trace.mkdir(parents=True, exist_ok=True)
        meta = {"aligned_ops": list(trace_names.per_row_globs()),
                "execution_contract": rl.contract(model)}
        with verify.Recorder(args.trace / f"{name}.db", run=name, meta=meta, overwrite=True) as recorder:
            with hooks.observe(lambda op, tensor, kind: recorder.record(op, tensor, kind=kind)):
                result = fn()
            recorder.step(param_grads=False)
        return result

    sampled = recorded("sampler", lambda: rl.generate(model, prompts, args.max_new_tokens, seed=0, batch_size=4))
    input_ids, attention_mask, completion_mask = sampled.padded()
    model.train()
    logprobs = recorded("trainer", lambda: rl.logprobs(model, input_ids, attention_mask))
    trainer = logprobs[completion_mask.to(logprobs.device)].detach().cpu()
    sampler = torch.cat(sampled.logprobs)
    print(f"{args.arch}: {sampler.numel()} sampled tokens, max |trainer - sampler| = "
          f"{(trainer - sampler).abs().max().item():.3g}, bitwise equal: {torch.equal(trainer, sampler)}")

    loss = -(logprobs * completion_mask.to(logprobs.device)).sum() / completion_mask.sum()
    loss.backward()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter -= 0.1 * parameter.grad
    print(f"one SGD step: loss {loss.item():.4f} -> "
          f"{-(rl.logprobs(model, input_ids, attention_mask)[completion_mask.to(logprobs.device)]).mean().item():.4f}")
    if args.trace is not None:
        names = " ".join(f"--name '{n}'" for n in trace_names.per_row_globs())
        print(f"mok-verify diff {args.trace / 'trainer.db'} {args.trace / 'sampler.db'} --align content {names}")
    return 0 if torch.equal(trainer, sampler) else 1


if __name__ == "__main__":
    sys.exit(main())
