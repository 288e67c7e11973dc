"""GRPO with verl's PPO trainer (FSDP2 actor, vLLM rollout), mok on both sides: verl's own
`training/rollout_probs_diff_max` reads exactly 0.0 at every step. Needs a CUDA GPU, vLLM and verl 0.9.1 in
one environment (verl's ResourcePoolManager places workers on GPUs only; on the CPU, tests/verl runs verl's
real engine instead):

    python -m examples.verl_grpo                     # 3 steps, tiny random Qwen3-MoE, one GPU
    python -m examples.verl_grpo --temperature 0.7   # any temperature: still exactly 0.0
    python -m examples.verl_grpo --sampler off       # negative control: vLLM's own ops -> a gap
    python -m examples.verl_grpo --trainer verl      # negative control: verl's own engine -> a gap
    python -m examples.verl_grpo --check             # any machine: compose and configure the run, then stop

The user's change is one line, marked below (`rl.verl.configure`). Each step prints verl's
`training/rollout_probs_diff_max` (max |exp(old log-prob) - exp(rollout log-prob)| over the step's response
tokens; verl computes the old log-probs with the actor after vLLM sampled, and syncs the weights into vLLM before
every rollout, so 0.0 at later steps also proves vLLM samples from the weights the actor just updated).

The task: prompts of 2-9 random words `t<id>` (rl.testing's word-level tokenizer), reward = the fraction of
response words with an even id.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

METRIC = "training/rollout_probs_diff_max"


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """verl's custom reward function: the fraction of words `t<id>` with an even id (0.0 when empty)."""
    words = solution_str.split()
    return sum(int(w[1:]) % 2 == 0 for w in words if w[1:].isdigit()) / max(len(words), 1)


def prepare(work: Path, prompts: int, seed: int) -> tuple[Path, Path]:
    """A tiny Qwen3-MoE checkpoint (with a chat template that joins the messages' text) and a parquet of prompts."""
    import pandas
    from transformers import AutoTokenizer

    from rl.testing import save_tiny_checkpoint

    checkpoint = save_tiny_checkpoint("qwen3_moe", work / "qwen3_moe", seed=seed)
    _newline_as_last_word(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(checkpoint)
    rng = random.Random(seed)
    rows = [{"data_source": "even_tokens", "prompt": [{"role": "user", "content": " ".join(
                f"t{rng.randrange(3, 511)}" for _ in range(rng.randrange(2, 10)))}],
             "reward_model": {"style": "rule", "ground_truth": ""}, "extra_info": {"index": i}}
            for i in range(prompts)]
    data = work / "prompts.parquet"
    pandas.DataFrame(rows).to_parquet(data)
    return checkpoint, data


def _newline_as_last_word(checkpoint: Path) -> None:
    """verl's agent loop tokenizes through a builder chosen by the model's type; Qwen's inserts the newline its
    chat template puts after a turn, so "\\n" must be one token (rl.testing's word-level tokenizer drops it as
    whitespace). The last word id becomes "\\n"; the prompts never use it."""
    path = checkpoint / "tokenizer.json"
    spec = json.loads(path.read_text())
    vocab = spec["model"]["vocab"]
    last = max(vocab, key=vocab.get)
    vocab["\n"] = vocab.pop(last)
    spec["added_tokens"].append(dict(id=vocab["\n"], content="\n", single_word=False, lstrip=False, rstrip=False,
                                     normalized=False, special=False))
    path.write_text(json.dumps(spec))


def rollout_prompt_ids(checkpoint: Path, messages: list[dict]) -> list[int]:
    """A prompt's token ids the way verl's agent loop builds them (its builder for the model's type)."""
    from transformers import AutoConfig, AutoTokenizer
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    builder = create_continuous_token_builder(AutoTokenizer.from_pretrained(checkpoint),
                                              hf_model_type=AutoConfig.from_pretrained(checkpoint).model_type)
    return builder.build_initial_tokens(messages)


def overrides(checkpoint: Path, data: Path, args) -> list[str]:
    """verl's hydra overrides for a tiny GRPO run on one GPU (the first block: what rl.verl needs)."""
    rollout, actor = "actor_rollout_ref.rollout", "actor_rollout_ref.actor"
    return [
        f"{actor}.strategy=fsdp2", "actor_rollout_ref.ref.strategy=fsdp2", f"{rollout}.name=vllm",
        f"{rollout}.tensor_model_parallel_size=1", f"{rollout}.calculate_log_probs=True",
        f"{rollout}.temperature={args.temperature}",
        "algorithm.adv_estimator=grpo", f"actor_rollout_ref.model.path={checkpoint}",
        f"data.train_files={data}", f"data.val_files={data}", "data.train_batch_size=4",
        "data.max_prompt_length=16", "data.max_response_length=8", f"{rollout}.n=4",
        f"{actor}.ppo_mini_batch_size=4", f"{actor}.ppo_micro_batch_size_per_gpu=4", f"{actor}.use_kl_loss=False",
        f"{rollout}.log_prob_micro_batch_size_per_gpu=4", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        f"{rollout}.gpu_memory_utilization={args.gpu_memory_utilization}", f"{rollout}.max_model_len=64",
        # 16 sequences per rollout: vLLM captures 5 CUDA-graph sizes instead of verl's default 51 (a faster start)
        f"{rollout}.max_num_seqs=16", f"{rollout}.cudagraph_capture_sizes=[1,2,4,8,16]",
        # a tiny run needs few helper processes (each storage unit holds a CPU of the Ray job; verl starts 8 of each)
        f"{rollout}.agent.num_workers=2", "reward.num_workers=1",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=2",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",  # loading only: mok's engine computes
        f"reward.custom_reward_function.path={Path(__file__).resolve()}",
        "reward.custom_reward_function.name=compute_score",
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1", f"trainer.total_training_steps={args.steps}",
        "trainer.logger=[console,file]", "trainer.val_before_train=False", "trainer.test_freq=-1",
        "trainer.save_freq=-1", "trainer.project_name=mok", "trainer.experiment_name=verl_grpo",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--sampler", choices=["mok", "off"], default="mok", help="off: vLLM without the plugin")
    parser.add_argument("--trainer", choices=["mok", "verl"], default="mok", help="verl: verl's own FSDP engine")
    parser.add_argument("--work", type=Path, default=Path("out/verl_grpo"))
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                        help="vLLM's share of the GPU (lower it to run several on one GPU)")
    parser.add_argument("--check", action="store_true", help="stop after rl.verl.configure (no GPU needed)")
    args = parser.parse_args(argv)
    from rl.logprobs import GREEDY_TEMPERATURE, sampling_temperature

    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if not sampling_temperature(args.temperature):
        parser.error(f"--temperature must be a finite number >= {GREEDY_TEMPERATURE} (vLLM samples greedily below)")
    if not 0 < args.gpu_memory_utilization <= 1:
        parser.error("--gpu-memory-utilization must be in (0, 1]")

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf, open_dict
    from verl.trainer import main_ppo

    import rl.verl

    args.work.mkdir(parents=True, exist_ok=True)
    checkpoint, data = prepare(args.work, prompts=16, seed=0)
    metrics_file = (args.work / "metrics.jsonl").resolve()
    metrics_file.unlink(missing_ok=True)
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(main_ppo.__file__), "config"),
                               version_base=None):
        config = compose("ppo_trainer", overrides=overrides(checkpoint, data, args))
    config = rl.verl.configure(config)  # the one line a verl user adds (or: python -m rl.verl OVERRIDES)
    env_vars = "ray_kwargs.ray_init.runtime_env.env_vars"
    OmegaConf.update(config, f"{env_vars}.VERL_FILE_LOGGER_PATH", str(metrics_file), force_add=True)
    if args.sampler == "off":
        OmegaConf.update(config, f"{env_vars}.MOK_VLLM", "0")
    if args.trainer == "verl":
        with open_dict(config):
            config.actor_rollout_ref.model.external_lib = None
    if args.check:
        model = config.actor_rollout_ref.model
        print(f"configured: external_lib={OmegaConf.to_container(model)['external_lib']!r}, rollout env "
              f"{OmegaConf.to_container(OmegaConf.select(config, env_vars))!r}")
        import pandas

        messages = list(pandas.read_parquet(data)["prompt"][0])
        print(f"rollout tokenizes {messages[0]['content']!r} to {rollout_prompt_ids(checkpoint, messages)}")
        return 0
    main_ppo.main.__wrapped__(config)

    steps = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    gaps = [step["data"].get(METRIC) for step in steps]
    for number, gap in enumerate(gaps, 1):
        print(f"step {number}: {METRIC} = {gap!r}")
    expected_zero = args.sampler == "mok" and args.trainer == "mok"
    print(f"sampler={args.sampler} trainer={args.trainer}: " + (
        "all 0.0" if all(g == 0.0 for g in gaps) else f"max {max(g for g in gaps if g is not None)!r}"))
    return 0 if gaps and (all(g == 0.0 for g in gaps) == expected_zero) else 1


if __name__ == "__main__":
    sys.exit(main())
