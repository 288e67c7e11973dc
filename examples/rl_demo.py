"""The main job: an on-policy RL loop (GRPO-style) on a tiny MoE model that proves, at every step, that
the trainer and the sampler computed bitwise-identical numbers.

    ./run demo                              # CPU: 20 steps, about a minute on 2 cores
    ./run demo --steps 2 --out out/a        # a short run
    ./run demo --baseline                   # trainer = plain transformers: a real gap, and where it starts
    ./run demo --json                       # JSON lines for machines
    ./run demo --nproc 2                    # trainer on 2 processes: FSDP2 + expert parallelism 2 (rl_demo_fsdp.py)
    PYTHONPATH=. python3 -m examples.rl_demo --device cuda   # GPU (larger model, Triton ops)

Each step: `--prompts` prompts of the copy task (examples/demo_model.py) x `--group` samples each from the sampler
(vLLM running mok's ops through the plugin when vLLM is installed, else `rl.generate`), a verifiable
reward per sampled token (the copy task scores each position on its own), advantages normalised within
each prompt's group per position, the trainer's log-probabilities of the sampled tokens (`rl.logprobs`
on the `rl.wrap`ped model), a clipped policy-gradient loss whose old log-probabilities are the
sampler's, and `--epochs` AdamW steps on that batch (GRPO's inner iterations; the first is on-policy: ratio
exactly 1, and its log-probabilities are the ones compared with the sampler's); the sampler then gets
the new weights. Both sides are recorded with verify (trainer.db, sampler.db: one trace step per RL
step, the trainer's from the first, on-policy pass) and the line printed per step says
max |trainer - sampler| (exactly 0) and the routing agreement read back from the traces (100%). Both
sides record the op names of rl/trace_names.py, plus the experts each token was routed to
(`layers.{i}.routes`); the per-row ones are compared by content, in data-path order.

Defaults (10 balanced prompts x 12 samples, 2 digits, 2 optimizer steps per batch, lr 1e-2): on the
CPU the mean reward climbs from ~0.03 (uniform over 64 tokens) past ~0.19 (any digit) to ~0.35-0.5
(copying) within 20 steps, in 45-55 s with vLLM on 2 cores. Per-token rewards, balanced prompts and
the second optimizer step per batch are what make the rise clear: with one reward per completion,
4 random prompts x 8 samples and one step, the policy collapsed onto fixed digits at ~0.2.
At the end: a summary table, metrics.png / agreement.png / report.html (verify.report), and the
final weights (checkpoint.safetensors). Running twice gives identical digests and checkpoints:

    mok-verify checkpoint out/a/checkpoint.safetensors out/b/checkpoint.safetensors
    mok-verify diff out/a/trainer.db out/b/trainer.db

The recorders, the agreement read back from the traces and the summary: examples/rl_demo_report.py.

Shapes: docs/shapes.md (B: the step's sequences, prompts x group; L: completion positions, one per digit;
T: sampled tokens, B x L).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NoReturn

import torch

from examples.demo_model import copy_position_rewards, copy_prompts, demo_model
from examples.rl_demo_report import (
    ALIGNED_OPS,
    BaselineTaps,
    DemoResult,
    SideRecorder,
    StepResult,
    percent,
    step_agreement,
    summary,
    xxhash_manifest,
)
from rl import trace_names

# -- samplers ------------------------------------------------------------------------------------------

@dataclass
class Samples:
    """prompts[i] + tokens[i] is sequence i; logprobs[i]: fp32 [len(tokens[i])], the sampler's."""

    prompts: list[list[int]]
    tokens: list[list[int]]
    logprobs: list[torch.Tensor]

    def padded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids [B, S], attention_mask [B, S], completion_mask [B, S-1]) with right padding."""
        import rl

        return rl.Generation(self.prompts, self.tokens, self.logprobs).padded()


class MokSampler:
    """`rl.generate`: the reference sampler, same decoder forward as the trainer, with a KV cache."""

    name = "rl.generate"

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def sample(self, prompts: list[list[int]], max_new_tokens: int, seeds: list[int]) -> Samples:
        import rl

        out = rl.generate(self.model, prompts, max_new_tokens, temperature=1.0, seed=seeds)
        return Samples(out.prompts, out.tokens, out.logprobs)

    def sync(self, model: torch.nn.Module) -> None:
        """Nothing to do: rl.generate reads the trainer's parameters directly."""

    def contract(self) -> dict:
        """The sampler's execution contract: rl.generate runs the trainer's model in this process."""
        import rl

        return rl.contract(self.model)

    def close(self) -> None:
        pass


class VllmSampler:
    """vLLM with the mok plugin (MOK_VLLM=1), in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that
    its ops are observed through mok.hooks like the trainer's. Weights go to it after every update."""

    name = "vllm+mok"

    SETTINGS = {"MOK_VLLM": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "ERROR"}

    def __init__(self, model: torch.nn.Module, workdir: Path, seed: int, device: str):
        self._saved_env = {key: os.environ.get(key) for key in (*self.SETTINGS, *self.DEFAULTS)}
        os.environ.update(self.SETTINGS)
        for key, value in self.DEFAULTS.items():
            os.environ.setdefault(key, value)
        from vllm import LLM

        checkpoint = workdir / "initial"
        model.save_pretrained(checkpoint, safe_serialization=True)
        self.llm = LLM(model=str(checkpoint), enforce_eager=True, dtype="bfloat16", skip_tokenizer_init=True,
                       gpu_memory_utilization=0.1 if device == "cpu" else 0.3, max_model_len=128,
                       max_num_seqs=64, max_num_batched_tokens=1024, enable_prefix_caching=False, seed=seed)

    def sample(self, prompts: list[list[int]], max_new_tokens: int, seeds: list[int]) -> Samples:
        from vllm import SamplingParams

        params = [SamplingParams(max_tokens=max_new_tokens, temperature=1.0, seed=s, logprobs=0, detokenize=False,
                                 ignore_eos=True) for s in seeds]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        tokens, logprobs = [], []
        for out in outputs:
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            tokens.append(ids)
            logprobs.append(torch.tensor([completion.logprobs[j][t].logprob for j, t in enumerate(ids)],
                                         dtype=torch.float32))
        return Samples([list(p) for p in prompts], tokens, logprobs)

    def contract(self) -> dict:
        """The sampler's execution contract, computed in vLLM's worker (here: this process)."""
        from rl.vllm.contract import sampler_contract

        return sampler_contract(self.llm)

    def sync(self, model: torch.nn.Module) -> None:
        """Load the trainer's weights into vLLM's model (checkpoint names: experts split per expert)."""
        weights = list(checkpoint_weights(model))
        self.llm.apply_model(lambda vllm_model: vllm_model.load_weights(iter(weights)))

    def close(self) -> None:
        import contextlib

        with contextlib.suppress(Exception):
            self.llm.llm_engine.engine_core.shutdown()
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def checkpoint_weights(model: torch.nn.Module):
    """(name, tensor) in the on-disk layout transformers writes: fused experts [E, 2I, H] / [E, H, I]
    become experts.{e}.gate_proj / up_proj / down_proj weights."""
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach()
        if name.endswith("experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            half = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield f"{base}{e}.gate_proj.weight", tensor[e, :half]
                yield f"{base}{e}.up_proj.weight", tensor[e, half:]
        elif name.endswith("experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(tensor.shape[0]):
                yield f"{base}{e}.down_proj.weight", tensor[e]
        else:
            yield name, tensor


def refuse(message: str) -> NoReturn:
    """A run that cannot start as asked: one line on stderr, exit code 2 (a usage error), nothing written."""
    print(f"rl_demo: error: {message}", file=sys.stderr)
    sys.exit(2)


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def choose_sampler(requested: str, device: str) -> str:
    """'vllm' or 'mok'. auto: vLLM when importable, on the CPU, and not disabled with MOK_VLLM=0."""
    if requested != "auto":
        if requested == "vllm" and not vllm_available():
            refuse("--sampler vllm, but vLLM is not installed (use --sampler mok)")
        return requested
    disabled = os.environ.get("MOK_VLLM", "").strip().lower() in ("0", "false", "no", "off")
    return "vllm" if device == "cpu" and vllm_available() and not disabled else "mok"


# -- the loop ------------------------------------------------------------------------------------------


def group_advantages(rewards_BL: torch.Tensor, group: int) -> torch.Tensor:
    """(r - mean over its group) / (std over its group + 1e-4), per column: fp32 [B] or [B, L] like the
    input (rows = sequences, consecutive `group` rows share a prompt; columns = token positions).

    Exactly 0 where a group's rewards in a column are all equal. Normalising alone would not give that:
    the fp32 mean of eight equal rewards can be off by an ulp (0.1 -> every advantage -7.45e-5), and
    AdamW, which is invariant to the gradient's scale, turns such a same-signed sliver into a full step
    that reinforces whatever the group sampled — pushing a collapsing policy further into collapse.
    """
    grouped = rewards_BL.reshape(-1, group, *rewards_BL.shape[1:])  # [prompts, group] or [prompts, group, L]
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    scaled = centered / (grouped.std(dim=1, keepdim=True, unbiased=False) + 1e-4)
    spread = grouped.amax(dim=1, keepdim=True) - grouped.amin(dim=1, keepdim=True)
    return torch.where(spread > 0, scaled, torch.zeros_like(scaled)).reshape(rewards_BL.shape)


def clipped_pg_loss(new_logprobs_T: torch.Tensor, old_logprobs_T: torch.Tensor, advantages_T: torch.Tensor,
                    clip: float) -> torch.Tensor:
    """PPO/GRPO clipped surrogate, mean over sampled tokens. All fp32 [T] (one entry per sampled token)."""
    ratio_T = torch.exp(new_logprobs_T - old_logprobs_T)
    unclipped_T = ratio_T * advantages_T
    clipped_T = ratio_T.clamp(1.0 - clip, 1.0 + clip) * advantages_T
    return -torch.minimum(unclipped_T, clipped_T).mean()


def baseline_logprobs(model: torch.nn.Module, input_ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor,
                      taps: BaselineTaps) -> torch.Tensor:
    """Plain transformers: fp32 [B, S-1] log p(token t+1), like rl.logprobs' layout (0 where not real)."""
    device = next(model.parameters()).device
    input_ids_BL, attention_mask_BL = input_ids_BL.to(device), attention_mask_BL.to(device)
    taps.real_BL = attention_mask_BL.bool()
    logits_BLV = model(input_ids=input_ids_BL, attention_mask=attention_mask_BL).logits
    logprobs_BLV = torch.log_softmax(logits_BLV[:, :-1].float(), dim=-1)
    picked_BL = logprobs_BLV.gather(-1, input_ids_BL[:, 1:, None]).squeeze(-1)
    keep_BL = attention_mask_BL[:, 1:].bool() & attention_mask_BL[:, :-1].bool()
    return torch.where(keep_BL, picked_BL, torch.zeros_like(picked_BL))


def run(args: argparse.Namespace, log=print) -> DemoResult:
    import safetensors.torch

    import rl
    from verify.report import log_metrics, step_digests, trace_digest, write_report

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    size = args.size or ("gpu" if device == "cuda" else "cpu")
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    model = demo_model(size, seed=args.seed, device=device)
    config = model.config
    if not args.baseline:
        rl.wrap(model)
    model.train()
    sampler_kind = choose_sampler(args.sampler, device)
    trainer_name = "transformers (plain, no wrapper)" if args.baseline else "rl.wrap (mok ops)"
    meta = {"seed": args.seed, "steps": args.steps, "size": size, "device": device, "sampler": sampler_kind,
            "baseline": args.baseline, "prompts": args.prompts, "group": args.group, "digits": args.digits,
            "lr": args.lr, "clip": args.clip, "epochs": args.epochs, "aligned_ops": list(ALIGNED_OPS)}
    order = trace_names.in_order(config.num_hidden_layers, routes=True)

    with ExitStack() as stack:
        sampler = (VllmSampler(model, out, args.seed, device) if sampler_kind == "vllm" else MokSampler(model))
        stack.callback(sampler.close)
        result = DemoResult(str(out), sampler.name, trainer_name, device)
        top_k, renorm = config.num_experts_per_tok, bool(config.norm_topk_prob)
        # The execution contracts (rl.contract); the baseline trainer runs transformers' own forward.
        trainer_contract = {**rl.contract(model), **({"forward": "transformers"} if args.baseline else {})}
        from rl.contract import comparable

        sampler_contract = {**comparable(sampler.contract()), **({"forward": "mok"} if args.baseline else {})}
        trainer_side = SideRecorder(out / "trainer.db", "trainer",
                                    {**meta, "side": "trainer", "partner": "sampler.db",
                                     "execution_contract": trainer_contract}, top_k, renorm)
        sampler_side = SideRecorder(out / "sampler.db", "sampler",
                                    {**meta, "side": "sampler", "execution_contract": sampler_contract}, top_k, renorm)
        stack.callback(sampler_side.recorder.close)
        stack.callback(trainer_side.recorder.close)
        # Parameter gradients of every module, recorded at each step (after backward, before the update).
        trainer_side.recorder.attach(model, include="*", forward=False, backward=False, params=True)
        taps = BaselineTaps(model, trainer_side) if args.baseline else None

        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0,
                                      foreach=False)
        prompt_generator = torch.Generator().manual_seed(args.seed)
        log(f"model: Qwen3-MoE ({size}: hidden {config.hidden_size}, {config.num_hidden_layers} layers, "
            f"{config.num_experts} experts, top-{top_k}) on {device} | sampler: {sampler.name} | "
            f"trainer: {trainer_name}")
        log(f"task: copy {args.digits} digits; {args.prompts} prompts x {args.group} samples per step, "
            f"{args.epochs} optimizer step(s) per batch, lr {args.lr:g}; "
            f"traces: {trainer_side.path}, {sampler_side.path}")

        from tqdm import tqdm

        bar = tqdm(range(args.steps), desc="rl steps", unit="step", disable=args.json or not sys.stderr.isatty(),
                   file=sys.stderr)
        for step in bar:
            start = time.perf_counter()
            samples, rewards_BL, advantages_BL = sample_batch(args, step, sampler, sampler_side, prompt_generator)
            input_ids, attention_mask, completion_mask = samples.padded()
            old_T = torch.cat(samples.logprobs)
            for epoch in range(args.epochs):
                # Only the first, on-policy pass is observed and compared with the sampler; later passes
                # see the weights after this batch's earlier updates (the clip bounds how far they go).
                with ExitStack() as observed:
                    if epoch == 0:
                        observed.enter_context(trainer_side.observing())
                        if taps is not None:
                            observed.enter_context(taps.observing())
                    if args.baseline:
                        new_BL = baseline_logprobs(model, input_ids, attention_mask, taps)
                    else:
                        new_BL = rl.logprobs(model, input_ids, attention_mask)
                new_T = new_BL[completion_mask.to(new_BL.device)]
                if epoch == 0:
                    first_T = new_T.detach().cpu()
                advantages_T = advantages_BL.reshape(-1).to(new_T.device)  # completion_mask order: row-major B, L
                loss = clipped_pg_loss(new_T, old_T.to(new_T.device), advantages_T, args.clip)
                loss.backward()
                if epoch == 0:
                    trainer_side.recorder.step()  # parameter gradients, then commit
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            sampler.sync(model)

            gap_T = (first_T - old_T).abs()
            routing, ops_ok, ops_compared, first = step_agreement(trainer_side.path, sampler_side.path, step, order)
            import xxhash

            digest = xxhash.xxh3_64(
                (step_digests(trainer_side.path, [step])[step] + step_digests(sampler_side.path, [step])[step]).encode()
            ).hexdigest()
            record = StepResult(step, float(rewards_BL.mean()), float(loss.detach()), float(gap_T.max()),
                                int((gap_T == 0).sum()), int(gap_T.numel()), routing, ops_ok, ops_compared, digest,
                                time.perf_counter() - start, first)
            result.steps.append(record)
            if first is not None and result.first_divergence is None:
                result.first_divergence = first
            log_metrics(trainer_side.path, step, {"reward": record.reward, "loss": record.loss,
                                                   "max_logprob_gap": record.max_logprob_gap,
                                                   "routing_agreement": routing})
            if args.json:
                print(json.dumps({"event": "step", **asdict(record)}), flush=True)
            else:
                line = (f"step {step:3d}  reward {record.reward:.3f}  loss {record.loss:+.2e}  "
                        f"max|trainer-sampler| {record.max_logprob_gap:.3g} "
                        f"({record.bitwise_equal_tokens}/{record.tokens} bitwise)  "
                        f"routing {percent(routing)}  ops {ops_ok}/{ops_compared}  digest {digest}")
                (bar.write if not bar.disable else log)(line)

    result.trace_digest = trace_digest(out / "trainer.db")
    result.sampler_digest = trace_digest(out / "sampler.db")
    checkpoint = out / "checkpoint.safetensors"
    state = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
    safetensors.torch.save_file(state, str(checkpoint), metadata={"seed": str(args.seed), "steps": str(args.steps)})
    result.checkpoint = str(checkpoint)
    result.checkpoint_digest = xxhash_manifest(checkpoint)
    result.report = str(write_report(out / "trainer.db", out, names=ALIGNED_OPS, order=order))
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rl_demo", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="RL steps (default 20)")
    parser.add_argument("--out", default="out/rl_demo", help="traces, plots, report, checkpoint go here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sampler", choices=("auto", "vllm", "mok"), default="auto",
                        help="vllm: vLLM with the mok plugin; mok: rl.generate; auto: vllm when installed (CPU)")
    parser.add_argument("--baseline", action="store_true",
                        help="trainer = the plain transformers model (no wrapper): shows the gap it leaves")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--size", choices=("cpu", "gpu"), default=None, help="model size (default: by device)")
    parser.add_argument("--prompts", type=int, default=10,
                        help="prompts per step (a multiple of 10 balances the digits, default 10)")
    parser.add_argument("--group", type=int, default=12, help="samples per prompt (the GRPO group, default 12)")
    parser.add_argument("--digits", type=int, default=2, help="digits to copy (L, default 2)")
    parser.add_argument("--epochs", type=int, default=2,
                        help="optimizer steps on each batch (GRPO's inner iterations; default 2)")
    parser.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate (default 1e-2)")
    parser.add_argument("--clip", type=float, default=0.2,
                        help="PPO/GRPO ratio clip; acts from the second optimizer step of a batch (default 0.2)")
    parser.add_argument("--json", action="store_true", help="JSON lines on stdout (one per step, then a summary)")
    parser.add_argument("--nproc", type=int, default=1,
                        help="trainer processes: FSDP2 + expert parallelism of this degree (gloo on the CPU, "
                             "NCCL on as many GPUs); the sampler stays in this process (examples/rl_demo_fsdp.py)")
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error("--nproc must be >= 1")
    if args.steps < 1 or args.prompts < 1 or args.group < 2 or args.digits < 1 or args.epochs < 1:
        parser.error("--steps, --prompts, --digits and --epochs must be >= 1, --group >= 2")
    # before the out folder is touched: a bad value never costs an earlier run's traces
    if not (math.isfinite(args.lr) and args.lr > 0) or not (math.isfinite(args.clip) and args.clip >= 0):
        parser.error("--lr must be a finite number > 0 and --clip a finite number >= 0")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        parser.error(f"--out {args.out} is a file, not a folder")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA GPU")
    return args


def sample_batch(args, step: int, sampler, sampler_side, prompt_generator: torch.Generator):
    """One step's rollouts: prompts x group samples (one seed each), recorded by the sampler's trace.
    -> (samples, rewards [B, L] per completion position, group-normalised advantages [B, L])."""
    base_prompts = copy_prompts(args.prompts, args.digits, prompt_generator)
    prompts = [p for p in base_prompts for _ in range(args.group)]
    seeds = [args.seed * 1_000_003 + step * len(prompts) + i for i in range(len(prompts))]
    with sampler_side.observing():
        samples = sampler.sample(prompts, args.digits, seeds)
    sampler_side.recorder.step(param_grads=False)
    if any(len(t) != args.digits for t in samples.tokens):  # no EOS stop: each completion has L tokens
        raise RuntimeError(f"rl_demo: the sampler returned completions of lengths "
                           f"{sorted({len(t) for t in samples.tokens})}, expected {args.digits}")
    rewards_BL = torch.tensor([copy_position_rewards(p, c) for p, c in zip(samples.prompts, samples.tokens)])
    return samples, rewards_BL, group_advantages(rewards_BL, args.group)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = (lambda *a, **k: None) if args.json else (lambda line: print(line, flush=True))
    if args.nproc > 1:
        from examples.rl_demo_fsdp import run_distributed

        result = run_distributed(args, log)
    else:
        result = run(args, log)
    if args.json:
        print(json.dumps({"event": "summary", **result.to_json()}), flush=True)
    else:
        print(summary(result, args.baseline), flush=True)
    if args.baseline:
        return 0 if any(s.max_logprob_gap > 0 for s in result.steps) else 1
    return 0 if result.bitwise else 1


if __name__ == "__main__":
    sys.exit(main())
