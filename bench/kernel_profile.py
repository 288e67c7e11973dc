"""Where the GPU time goes: CUDA kernel times (torch.profiler) of mok's MoE decode and of one trainer step,
summed by kernel name, as JSON lines. A tool for choosing the next kernel work, not a speed claim.

    PYTHONPATH=. python bench/kernel_profile.py --out profile.jsonl [--targets moe_decode,moe_eager,step,dense]
        [--tokens 1,64,512] [--dense-ops rms_norm,silu_and_mul] [--dense-tokens 4096]

moe_decode: mok.moe inference (no grad) of each bench/moe.py shape at each T, replayed from a CUDA graph
(what vLLM runs), 20 replays. step: one bench/step.py trainer step (mok and transformers) at --step-config.
One line per (target, kernel): total ms per call, launches per call, share of the call's kernel time.
moe_eager: the same calls eager, split like dense below.
moe_train: mok.moe forward+backward of each shape at each --train-tokens (the trainer's layer), eager: the kernel
table, then one line with the call's ms timed as bench/moe.py does (from an idle GPU) and back to back, the host's
enqueue time, and the largest idle gaps of the GPU inside one call with the kernels around each.
dense: each bench/dense.py case's forward+backward, mok and torch, where the time goes between host and GPU:
one line per (op, T, side) with the CUDA-event ms per call, the host's ms per call (wall clock of the calls
without a synchronisation: above the event ms, the call is bound by its Python), the kernels' ms and launches
per call, and the host functions with the most own time (cProfile).
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile


def kernel_table(run, calls: int) -> list[dict]:
    """run() `calls` times under the profiler -> [{kernel, ms_per_call, launches_per_call, share}] by time."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    total_us, count = defaultdict(float), defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total_us[event.name] += event.device_time
            count[event.name] += 1
    whole = sum(total_us.values()) or 1.0
    rows = [dict(kernel=name[:120], ms_per_call=round(us / calls / 1e3, 4), launches_per_call=count[name] / calls,
                 share=round(us / whole, 4)) for name, us in total_us.items()]
    return sorted(rows, key=lambda row: -row["ms_per_call"])


def host_table(run, calls: int, top: int = 12) -> list[dict]:
    """run() `calls` times under cProfile -> the `top` functions by own time: [{function, ms_per_call, ncalls}]."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    profiler.enable()
    for _ in range(calls):
        run()
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats
    rows = [dict(function=f"{path.rsplit('/', 2)[-1]}:{line}({name})", ms_per_call=round(own / calls * 1e3, 4),
                 ncalls=ncalls / calls) for (path, line, name), (_, ncalls, own, _, _) in stats.items()]
    return sorted(rows, key=lambda row: -row["ms_per_call"])[:top]


def dense_split(run, calls: int = 20) -> dict:
    """Host and GPU time of run(): {event_ms, host_ms, kernel_ms, launches} per call."""
    import time

    from bench.timing import cuda_ms

    event_ms = cuda_ms(run, warmup=3, iters=calls)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        run()
    host_ms = (time.perf_counter() - start) / calls * 1e3
    torch.cuda.synchronize()
    kernels = kernel_table(run, calls)
    return dict(event_ms=round(event_ms, 4), host_ms=round(host_ms, 4),
                kernel_ms=round(sum(r["ms_per_call"] for r in kernels), 4),
                launches=sum(r["launches_per_call"] for r in kernels), kernels=kernels[:8])


def idle_gaps(run, top: int = 10) -> dict:
    """One call of run() from an idle GPU under a CUDA-only profile: {span_ms (first kernel start to last kernel
    end), busy_ms (the union of the kernels' intervals: PDL-launched kernels overlap), idle_ms, gaps: the `top`
    largest idle intervals [{us, after: the kernel that ended last before it, before}]} (kernel names cut)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name[:60]) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    if not kernels:
        return dict(span_ms=0.0, busy_ms=0.0, idle_ms=0.0, gaps=[])
    gaps = []
    reach, reach_name = kernels[0][1], kernels[0][2]
    for start, end, name in kernels[1:]:
        if start > reach:
            gaps.append(dict(us=round(start - reach, 1), after=reach_name, before=name))
        if end > reach:
            reach, reach_name = end, name
    span = reach - kernels[0][0]
    idle = sum(gap["us"] for gap in gaps)
    gaps.sort(key=lambda gap: -gap["us"])
    return dict(span_ms=round(span / 1e3, 4), busy_ms=round((span - idle) / 1e3, 4), idle_ms=round(idle / 1e3, 4),
                gaps=gaps[:top])


def call_split(run, calls: int = 10) -> dict:
    """{sync_ms: median CUDA-event ms of one call from an idle GPU (bench/moe.py's timing), back_to_back_ms: mean ms
    per call of `calls` calls without a synchronisation, host_ms: the host's wall clock to enqueue one call}."""
    import time

    from bench.moe import time_ms
    from bench.timing import cuda_ms

    sync_ms = time_ms(run, min_iters=calls, max_iters=calls)
    back_to_back_ms = cuda_ms(run, warmup=2, iters=calls)
    torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    host_ms = (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    return dict(sync_ms=round(sync_ms, 4), back_to_back_ms=round(back_to_back_ms, 4), host_ms=round(host_ms, 4))


def moe_inputs(shape: str, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(x [T, H] bf16, logits [T, E] fp32, w13 [E, 2I, H] bf16, w2 [E, H, I] bf16, top_k) of a bench/moe.py shape."""
    from bench.moe import SHAPES

    hidden, inter, num_experts, top_k = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen) * 0.02).bfloat16()
    w2 = (torch.randn(num_experts, hidden, inter, device="cuda", generator=gen) * 0.02).bfloat16()
    x = torch.randn(num_tokens, hidden, device="cuda", generator=gen).bfloat16()
    logits = torch.randn(num_tokens, num_experts, device="cuda", generator=gen)
    return x, logits, w13, w2, top_k


def moe_decode(shape: str, num_tokens: int, graph: bool = True):
    """A replay function of mok.moe inference at this shape and T, captured in a CUDA graph (or the eager call)."""
    import mok
    from bench.timing import capture_graph

    x, logits, w13, w2, top_k = moe_inputs(shape, num_tokens)

    def run():
        with torch.no_grad():
            return mok.moe(x, logits, w13, w2, top_k)

    return capture_graph(run).replay if graph else run


def moe_train(shape: str, num_tokens: int):
    """mok.moe forward+backward at this shape and T (gradients of x, logits, w13, w2), eager."""
    import mok

    *tensors, top_k = moe_inputs(shape, num_tokens)
    leaves = [t.requires_grad_() for t in tensors]
    grad_out = torch.randn_like(leaves[0])

    def run():
        for leaf in leaves:
            leaf.grad = None
        mok.moe(*leaves, top_k).backward(grad_out)

    run()
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--targets", default="moe_decode,step")
    parser.add_argument("--shapes", default="qwen3-30b-a3b,olmoe-1b-7b,mixtral-8x7b")
    parser.add_argument("--tokens", default="1,64,512")
    parser.add_argument("--train-tokens", default="16384")
    parser.add_argument("--step-config", default="8x4096")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--dense-ops", default="rms_norm,rms_norm_residual,rotary,silu_and_mul,linear_qkv")
    parser.add_argument("--dense-tokens", default="4096")
    args = parser.parse_args()
    targets = args.targets.split(",")
    with open(args.out, "w") as out:
        def emit(target: str, rows: list[dict]) -> None:
            for row in rows[:args.top]:
                out.write(json.dumps(dict(target=target, **row)) + "\n")
            out.flush()
            print(target, "total ms per call", round(sum(r["ms_per_call"] for r in rows), 4), flush=True)

        if "moe_decode" in targets:
            for shape in args.shapes.split(","):
                for num_tokens in (int(t) for t in args.tokens.split(",")):
                    emit(f"moe_decode {shape} T={num_tokens}", kernel_table(moe_decode(shape, num_tokens), 20))
        if "moe_train" in targets:
            for shape in args.shapes.split(","):
                for num_tokens in (int(t) for t in args.train_tokens.split(",")):
                    run = moe_train(shape, num_tokens)
                    emit(f"moe_train {shape} T={num_tokens}", kernel_table(run, 3))
                    row = dict(target=f"moe_train {shape} T={num_tokens} timeline", **call_split(run), **idle_gaps(run))
                    out.write(json.dumps(row) + "\n")
                    print(json.dumps(row), flush=True)
                    del run
                    torch.cuda.empty_cache()
        if "moe_eager" in targets:
            for shape in args.shapes.split(","):
                for num_tokens in (int(t) for t in args.tokens.split(",")):
                    run = moe_decode(shape, num_tokens, graph=False)
                    row = dict(target=f"moe_eager {shape} T={num_tokens}", **dense_split(run),
                               host_functions=host_table(run, 50, top=25))
                    out.write(json.dumps(row) + "\n")
                    print(row["target"], {k: row[k] for k in ("event_ms", "host_ms", "kernel_ms", "launches")},
                          flush=True)
        if "dense" in targets:
            from bench import dense

            for num_tokens in (int(t) for t in args.dense_tokens.split(",")):
                for case in dense.cases(dense.SHAPES["qwen3-30b-a3b"], num_tokens, torch.device("cuda"),
                                        args.dense_ops.split(",")):
                    for side, fn in (("mok", case.mok), ("torch", case.torch_fn)):
                        run = dense.forward_backward_call(fn, case.inputs, case.differentiable)
                        row = dict(target=f"dense {case.op} T={num_tokens} {side} fwd+bwd", **dense_split(run),
                                   host_functions=host_table(run, 20))
                        out.write(json.dumps(row) + "\n")
                        out.flush()
                        print(row["target"], {k: row[k] for k in ("event_ms", "host_ms", "kernel_ms", "launches")},
                              flush=True)
        if "step" in targets:
            import rl
            from bench.step import QWEN3_30B_A3B_LAYERS, _transformers_logprobs
            from rl.testing import tiny_model

            batch, length = (int(x) for x in args.step_config.split("x"))
            ids_BL = torch.randint(3, QWEN3_30B_A3B_LAYERS["vocab_size"], (batch, length), device="cuda")
            for side in ("mok", "transformers"):
                model = tiny_model("qwen3_moe", seed=0, device="cuda", **QWEN3_30B_A3B_LAYERS)
                if side == "mok":
                    model = rl.wrap(model)
                else:
                    model.set_attn_implementation("sdpa")
                model.train()

                def step():
                    model.zero_grad(set_to_none=True)
                    if side == "mok":
                        rl.logprobs(model, ids_BL, torch.ones_like(ids_BL)).sum().backward()
                    else:
                        _transformers_logprobs(model, ids_BL).sum().backward()

                step()
                emit(f"step {side} {args.step_config}", kernel_table(step, 2))
                del model
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
