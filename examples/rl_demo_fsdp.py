"""`./run demo --nproc N`: the demo's trainer on N processes, FSDP2 + expert parallelism of degree N
(rl.distributed.shard; gloo on the CPU, NCCL on N GPUs), the sampler in the launching process.

The launching process (the driver) runs what `examples/rl_demo.py` runs in one process, except training:
it samples (vLLM with the mok plugin, or rl.generate), records the sampler's trace, computes rewards and
advantages, and sends each step's batch to the N trainer ranks. Rank r trains on its contiguous share of
the batch's sequences (B / N of them), with the dense weights sharded over all ranks and the experts
split into N blocks (each rank's tokens go to the ranks that hold their experts and come back: the bits
of one process, mok/distributed.py). Rank 0 records the trainer's trace for its share (the ops of the
on-policy pass; parameter gradients are not recorded, they are sharded); every rank returns the
log-probabilities of its sampled tokens, and rank 0 the full weights after the step's optimizer steps,
which the driver loads into the sampler. The printed gap is over all B sequences: exactly 0.

Why the sampler is not a rank: vLLM (in-process, as the demo runs it to observe its ops) sets up its own
torch.distributed world of one process, which cannot share a process with the trainers' world.
A rerun with the same N gives identical traces and checkpoint; runs with other N differ (the dense
gradients are reduced across ranks), while every step's gap stays 0.

Shapes: docs/shapes.md.
"""
from __future__ import annotations

import datetime
import os
import queue
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path

import torch

from examples import rl_demo as demo
from examples.demo_model import demo_model
from rl import trace_names

RANK_TIMEOUT_S = 600


def _rank_main(rank: int, world_size: int, init_method: str, args: dict, meta: dict, contract: dict, inbox, outbox):
    """One trainer rank: shard the model, then train on every batch the driver sends until told to stop."""
    import argparse

    import torch.distributed as dist

    import rl
    import rl.distributed

    args = argparse.Namespace(**args)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", init_method=init_method, rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=RANK_TIMEOUT_S))
    try:
        torch.manual_seed(args.seed)
        model = demo_model(args.size, seed=args.seed, device=device)
        rl.wrap(model)
        model.train()
        rl.distributed.shard(model, ep_size=world_size)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0,
                                      foreach=False)
        config = model.config
        trainer_side = None
        if rank == 0:
            trainer_side = demo.SideRecorder(Path(args.out) / "trainer.db", "trainer",
                                             {**meta, "side": "trainer", "partner": "sampler.db",
                                              "execution_contract": contract},
                                             config.num_experts_per_tok, bool(config.norm_topk_prob))
        while True:
            message = inbox.get(timeout=RANK_TIMEOUT_S)
            if message[0] == "stop":
                break
            _, step, input_ids, attention_mask, completion_mask, old_T, advantages_BL = message
            rows = input_ids.shape[0] // world_size
            mine = slice(rank * rows, (rank + 1) * rows)
            offset = _token_offset(completion_mask, mine)  # this rank's sampled tokens, in row-major order
            input_ids, attention_mask = input_ids[mine], attention_mask[mine]
            completion_mask, advantages_BL = completion_mask[mine], advantages_BL[mine]
            old_mine = old_T[offset:offset + int(completion_mask.sum())]
            for epoch in range(args.epochs):
                with ExitStack() as observed:
                    if epoch == 0 and trainer_side is not None:
                        observed.enter_context(trainer_side.observing())
                    new_BL = rl.logprobs(model, input_ids, attention_mask)
                new_T = new_BL[completion_mask.to(new_BL.device)]
                if epoch == 0:
                    first_T = new_T.detach().cpu()
                advantages_T = advantages_BL.reshape(-1).to(new_T.device)
                loss = demo.clipped_pg_loss(new_T, old_mine.to(new_T.device), advantages_T, args.clip)
                loss.backward()
                if epoch == 0 and trainer_side is not None:
                    trainer_side.recorder.step(param_grads=False)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            state = rl.distributed.full_state_dict(model)
            reply = {"rank": rank, "step": step, "first_T": first_T, "loss": float(loss.detach())}
            if rank == 0:
                reply["state"] = {name: t.detach().cpu() for name, t in state.items()}
            outbox.put(reply)
        if trainer_side is not None:
            trainer_side.recorder.close()
    finally:
        dist.destroy_process_group()


def _token_offset(completion_mask_BL: torch.Tensor, rows: slice) -> int:
    """Index of the first sampled token of sequence rows.start in the row-major list of sampled tokens."""
    return int(completion_mask_BL[:rows.start].sum())


def run_distributed(args, log=print) -> demo.DemoResult:
    """The demo with N = args.nproc trainer ranks (see the module docstring); -> demo.DemoResult."""
    import torch.multiprocessing as mp

    import rl
    from verify.report import log_metrics, step_digests, trace_digest, write_report

    world_size = args.nproc
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and torch.cuda.device_count() < world_size:
        demo.refuse(f"--nproc {world_size} on CUDA needs {world_size} GPUs, "
                         f"{torch.cuda.device_count()} present")
    if args.baseline:
        demo.refuse("--baseline runs in one process (drop --nproc)")
    if (args.prompts * args.group) % world_size:
        demo.refuse(f"prompts x group = {args.prompts * args.group} sequences do not split over "
                         f"--nproc {world_size} ranks")
    size = args.size or ("gpu" if device == "cuda" else "cpu")
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    model = demo_model(size, seed=args.seed, device=device)  # the sampler's copy of the weights
    config = model.config
    if config.num_experts % world_size:
        demo.refuse(f"{config.num_experts} experts do not split over --nproc {world_size} ranks")
    rl.wrap(model)
    sampler_kind = demo.choose_sampler(args.sampler, device)
    trainer_name = f"rl.wrap (mok ops) on {world_size} ranks: FSDP2 + expert parallelism {world_size}"
    meta = {"seed": args.seed, "steps": args.steps, "size": size, "device": device, "sampler": sampler_kind,
            "baseline": False, "prompts": args.prompts, "group": args.group, "digits": args.digits,
            "lr": args.lr, "clip": args.clip, "epochs": args.epochs, "aligned_ops": list(demo.ALIGNED_OPS),
            "nproc": world_size, "ep_size": world_size}
    order = trace_names.in_order(config.num_hidden_layers, routes=True)

    with ExitStack() as stack:
        sampler = (demo.VllmSampler(model, out, args.seed, device) if sampler_kind == "vllm"
                   else demo.MokSampler(model))
        stack.callback(sampler.close)
        result = demo.DemoResult(str(out), sampler.name, trainer_name, device)
        top_k, renorm = config.num_experts_per_tok, bool(config.norm_topk_prob)
        from rl.contract import comparable

        trainer_contract = rl.contract(model)  # every rank runs this model's ops (sharded after the contract)
        sampler_side = demo.SideRecorder(out / "sampler.db", "sampler",
                                         {**meta, "side": "sampler",
                                          "execution_contract": comparable(sampler.contract())}, top_k, renorm)
        stack.callback(sampler_side.recorder.close)

        context = mp.get_context("spawn")
        inboxes = [context.Queue() for _ in range(world_size)]
        outbox = context.Queue()
        init_method = f"file://{tempfile.mkdtemp(prefix='mok-demo-')}/store"
        rank_args = {**vars(args), "device": device, "size": size}
        procs = [context.Process(target=_rank_main, args=(rank, world_size, init_method, rank_args, meta,
                                                          trainer_contract, inboxes[rank], outbox), daemon=True)
                 for rank in range(world_size)]
        for proc in procs:
            proc.start()

        def stop_ranks():
            for inbox in inboxes:
                inbox.put(("stop",))
            for proc in procs:
                proc.join(timeout=RANK_TIMEOUT_S)
                if proc.is_alive():
                    proc.kill()

        stack.callback(stop_ranks)
        log(f"model: Qwen3-MoE ({size}: hidden {config.hidden_size}, {config.num_hidden_layers} layers, "
            f"{config.num_experts} experts, top-{top_k}) | sampler: {sampler.name} (driver process) | "
            f"trainer: {trainer_name}")
        log(f"task: copy {args.digits} digits; {args.prompts} prompts x {args.group} samples per step "
            f"({args.prompts * args.group // world_size} sequences per rank), {args.epochs} optimizer step(s) "
            f"per batch, lr {args.lr:g}; traces: {out / 'trainer.db'} (rank 0's share), {sampler_side.path}")

        prompt_generator = torch.Generator().manual_seed(args.seed)
        for step in range(args.steps):
            start = time.perf_counter()
            samples, rewards_BL, advantages_BL = demo.sample_batch(args, step, sampler, sampler_side,
                                                                   prompt_generator)
            input_ids, attention_mask, completion_mask = samples.padded()
            old_T = torch.cat(samples.logprobs)
            for inbox in inboxes:
                inbox.put(("step", step, input_ids, attention_mask, completion_mask, old_T, advantages_BL))
            replies = {}
            while len(replies) < world_size:
                try:
                    reply = outbox.get(timeout=5)
                except queue.Empty:
                    dead = [rank for rank, proc in enumerate(procs) if not proc.is_alive()]
                    if dead:
                        raise RuntimeError(f"rl_demo: trainer rank(s) {dead} exited") from None
                    continue
                replies[reply["rank"]] = reply
            first_T = torch.cat([replies[rank]["first_T"] for rank in range(world_size)])
            loss = replies[0]["loss"]
            with torch.no_grad():
                model.load_state_dict(replies[0]["state"])
            sampler.sync(model)

            gap_T = (first_T - old_T).abs()
            routing, ops_ok, ops_compared, first = demo.step_agreement(out / "trainer.db", sampler_side.path, step,
                                                                       order)
            import xxhash

            digest = xxhash.xxh3_64((step_digests(out / "trainer.db", [step])[step]
                                     + step_digests(sampler_side.path, [step])[step]).encode()).hexdigest()
            record = demo.StepResult(step, float(rewards_BL.mean()), loss, float(gap_T.max()),
                                     int((gap_T == 0).sum()), int(gap_T.numel()), routing, ops_ok, ops_compared,
                                     digest, time.perf_counter() - start, first)
            result.steps.append(record)
            if first is not None and result.first_divergence is None:
                result.first_divergence = first
            log_metrics(out / "trainer.db", step, {"reward": record.reward, "loss": record.loss,
                                                    "max_logprob_gap": record.max_logprob_gap,
                                                    "routing_agreement": routing})
            if args.json:
                import json

                print(json.dumps({"event": "step", **asdict(record)}), flush=True)
            else:
                log(f"step {step:3d}  reward {record.reward:.3f}  loss {record.loss:+.2e}  "
                    f"max|trainer-sampler| {record.max_logprob_gap:.3g} "
                    f"({record.bitwise_equal_tokens}/{record.tokens} bitwise)  "
                    f"routing {demo.percent(routing)}  ops {ops_ok}/{ops_compared}  digest {digest}")

    import safetensors.torch

    result.trace_digest = trace_digest(out / "trainer.db")
    result.sampler_digest = trace_digest(out / "sampler.db")
    checkpoint = out / "checkpoint.safetensors"
    state = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
    safetensors.torch.save_file(state, str(checkpoint), metadata={"seed": str(args.seed), "steps": str(args.steps),
                                                                  "nproc": str(world_size)})
    result.checkpoint = str(checkpoint)
    result.checkpoint_digest = demo.xxhash_manifest(checkpoint)
    result.report = str(write_report(out / "trainer.db", out, names=demo.ALIGNED_OPS, order=order))
    return result
