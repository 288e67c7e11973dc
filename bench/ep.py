"""Benchmark of mok's expert-parallel MoE layer (mok.moe with ep_group) against an all_to_all +
torch._grouped_mm expert-parallel layer (torchtitan style: not batch-invariant, not EP-invariant), in the
same run, on 1-8 GPUs of one host (NCCL) or CPU processes (gloo; a smoke run: the CPU reference is
written for exactness, not speed).

    torchrun --nproc-per-node 8 bench/ep.py --out ep.jsonl                     # 8 GPUs, EP = 8
    PYTHONPATH=. python bench/ep.py --nproc 1 --out ep.jsonl                   # one GPU (EP = 1), self-spawned
    PYTHONPATH=. python bench/ep.py --nproc 2 --device cpu --shapes tiny --tokens 64 --out ep.jsonl   # CPU

Every rank holds E/P experts (expert e's weights are seeded by e, so they do not depend on P) and its
own `--tokens` tokens per GPU (seeded by rank); the expert-parallel group is the whole world. One JSON
line per (shape, tokens per GPU, pass, impl) from rank 0: ms per layer call (the slowest rank's median),
TFLOP/s per GPU (forward 6*T*K*H*I per GPU, forward+backward 3x that; T = tokens per GPU), tokens/s per
GPU, speedup_vs_grouped_mm (baseline ms / mok ms) and, for reference, the baseline TFLOP/s per GPU
measured on two H200 at 8192 tokens per GPU, forward+backward (issue 15: qwen3-30b-a3b 157, deepseek-v3
270, mixtral-8x7b 456). `--check` (small shapes) also compares mok's EP output with mok.moe on one rank
over every rank's tokens and all experts (all-gathered): the bits must be equal.
Shapes: docs/shapes.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.moe import SHAPES as MOE_SHAPES

SHAPES = {name: MOE_SHAPES[name] for name in ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b")}  # name: (H, I, E, K)
SHAPES["tiny"] = (64, 32, 16, 4)
BASELINE_TWO_H200_TFLOPS = {"qwen3-30b-a3b": 157, "deepseek-v3": 270, "mixtral-8x7b": 456}
"""all_to_all + grouped_mm, forward+backward, 8192 tokens per GPU, two H200 (issue 15)."""


# ---------------------------------------------------------------------------------------------
# the baseline: routing in torch, all_to_all_single dispatch and return, torch._grouped_mm experts


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows with split sizes; the backward sends the gradient rows back."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out = x.new_empty(sum(recv_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        out = grad.new_empty(sum(send_splits), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), send_splits, recv_splits, group=ctx.group)
        return out, None, None, None


def grouped_mm_ep_moe(x_TH, logits_TE, w13_E2IH, w2_EHI, top_k, group):
    """x [T, H], logits [T, E] over all experts, this rank's w13 [E/P, 2I, H] and w2 [E/P, H, I] -> [T, H]."""
    size = dist.get_world_size(group)
    num_tokens, hidden = x_TH.shape
    local, two_inter, _ = w13_E2IH.shape
    num_experts = local * size
    probs_TE = torch.softmax(logits_TE.float(), dim=-1)
    weights_TK, ids_TK = torch.topk(probs_TE, top_k, dim=-1)
    weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    flat_N = ids_TK.reshape(-1)
    order_N = torch.argsort(flat_N, stable=True)  # by expert: by destination rank, then its local expert
    counts_E = torch.bincount(flat_N, minlength=num_experts)
    recv_counts_PE = torch.empty_like(counts_E)
    dist.all_to_all_single(recv_counts_PE, counts_E, group=group)  # [P * E/P]: source rank, local expert
    send_splits = counts_E.view(size, local).sum(1).tolist()
    recv_counts_PE = recv_counts_PE.view(size, local)
    recv_splits = recv_counts_PE.sum(1).tolist()
    x_recv = _AllToAll.apply(x_TH[order_N // top_k], send_splits, recv_splits, group)
    # received rows: by source rank, then local expert; the grouped GEMMs want them by local expert
    local_ids = torch.repeat_interleave(torch.arange(local, device=x_TH.device).repeat(size),
                                        recv_counts_PE.reshape(-1))
    perm = torch.argsort(local_ids, stable=True)
    offsets = torch.cumsum(recv_counts_PE.sum(0), 0).to(torch.int32)
    h = torch._grouped_mm(x_recv[perm], w13_E2IH.transpose(-2, -1), offs=offsets)
    act = F.silu(h[:, :two_inter // 2]) * h[:, two_inter // 2:]
    y = torch._grouped_mm(act, w2_EHI.transpose(-2, -1), offs=offsets)
    y_recv = torch.empty_like(y).index_copy(0, perm, y)
    y_back = _AllToAll.apply(y_recv, recv_splits, send_splits, group)
    y_back = y_back * weights_TK.reshape(-1)[order_N, None].to(y_back.dtype)
    return torch.zeros(num_tokens, hidden, device=x_TH.device, dtype=x_TH.dtype).index_add(0, order_N // top_k, y_back)


def mok_ep_moe(x_TH, logits_TE, w13_E2IH, w2_EHI, top_k, group):
    import mok

    return mok.moe(x_TH, logits_TE, w13_E2IH, w2_EHI, top_k, ep_group=group)


IMPLS = {"mok": mok_ep_moe, "grouped_mm": grouped_mm_ep_moe}


# ---------------------------------------------------------------------------------------------
# timing (every rank times its own calls; the row reports the slowest rank)


def time_ms(fn, device, min_iters=5, max_iters=50, budget_s=2.0) -> float:
    """Median ms per call of fn() after warm-up: CUDA events on a GPU, the wall clock on the CPU. The ranks
    start together (a barrier) and run the same number of calls (collectives inside fn keep them in step)."""
    for _ in range(2):
        fn()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    # the number of calls is decided on rank 0 and shared, so every rank runs the same collectives
    probe_start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    per_call = torch.tensor([time.perf_counter() - probe_start], dtype=torch.float64, device=device)
    dist.all_reduce(per_call, op=dist.ReduceOp.MAX)
    iters = int(min(max_iters, max(min_iters, budget_s / max(per_call.item(), 1e-6))))
    times = []
    dist.barrier()
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            start_s = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start_s) * 1e3)
    median = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return median.item()


def local_weights(shape: str, device, group):
    """This rank's experts, expert e's weights from a generator seeded by e (the same at every P)."""
    from mok.distributed import local_experts

    hidden, inter, num_experts, _ = SHAPES[shape]
    w13, w2 = [], []
    for expert in local_experts(num_experts, group):
        gen = torch.Generator().manual_seed(expert)
        w13.append((torch.randn(2 * inter, hidden, generator=gen) / hidden ** 0.5).bfloat16())
        w2.append((torch.randn(hidden, inter, generator=gen) / inter ** 0.5).bfloat16())
    return torch.stack(w13).to(device), torch.stack(w2).to(device)


def bench_case(shape, num_tokens, pass_name, impl, weights, device, group):
    hidden, inter, num_experts, top_k = SHAPES[shape]
    rank = dist.get_rank(group)
    gen = torch.Generator().manual_seed(1000 * rank + num_tokens)
    x = torch.randn(num_tokens, hidden, generator=gen).bfloat16().to(device)
    logits = torch.randn(num_tokens, num_experts, generator=gen).to(device)
    w13, w2 = weights
    fn = IMPLS[impl]
    if pass_name == "fwd":
        def run():
            with torch.no_grad():
                return fn(x, logits, w13, w2, top_k, group)
    else:
        leaves = [t.detach().requires_grad_() for t in (x, logits, w13, w2)]
        grad_out = torch.randn(num_tokens, hidden, generator=gen).bfloat16().to(device)

        def run():
            for t in leaves:
                t.grad = None
            fn(*leaves, top_k, group).backward(grad_out)
    ms = time_ms(run, device)
    flops = 6 * num_tokens * top_k * hidden * inter * (3 if pass_name == "fwd+bwd" else 1)
    return {"ms": float(f"{ms:.5g}"), "tflops_per_gpu": float(f"{flops / ms / 1e9:.4g}"),
            "tokens_per_s_per_gpu": float(f"{num_tokens / ms * 1e3:.5g}")}


def check_bits(shape, num_tokens, weights, device, group) -> bool:
    """mok EP output == mok.moe on one rank over all ranks' tokens and all experts (gathered)."""
    import mok

    hidden, inter, num_experts, top_k = SHAPES[shape]
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    gen = torch.Generator().manual_seed(1000 * rank + num_tokens)
    x = torch.randn(num_tokens, hidden, generator=gen).bfloat16().to(device)
    logits = torch.randn(num_tokens, num_experts, generator=gen).to(device)
    with torch.no_grad():
        out = mok_ep_moe(x, logits, *weights, top_k, group)

        def gather(t):
            parts = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(parts, t.contiguous(), group=group)
            return torch.cat(parts)

        full = mok.moe(gather(x), gather(logits), gather(weights[0]), gather(weights[1]), top_k)
    same = torch.tensor([int(torch.equal(out, full[rank * num_tokens:(rank + 1) * num_tokens]))], device=device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item())


# ---------------------------------------------------------------------------------------------
# driver


def run(args, rank: int, world_size: int, init_method: str | None) -> int:
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", rank % max(1, torch.cuda.device_count())) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method=init_method, rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(minutes=10))
    group = dist.group.WORLD
    shapes = [s for s in args.shapes.split(",") if s]
    tokens = [int(t) for t in args.tokens.split(",") if t]
    passes = [p for p in args.passes.split(",") if p]
    impls = [i for i in args.impls.split(",") if i]
    meta = {"kind": "meta", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "world_size": world_size, "ep": world_size, "backend": dist.get_backend(),
            "device": torch.cuda.get_device_name(device) if use_cuda else "cpu", "torch": torch.__version__}
    out = open(args.out, "a") if rank == 0 else None

    def emit(row):
        if out is not None:
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(json.dumps(row), flush=True)

    emit(meta)
    for shape in shapes:
        hidden, inter, num_experts, top_k = SHAPES[shape]
        if num_experts % world_size:
            emit({"shape": shape, "skipped": f"{num_experts} experts are not divisible by {world_size} ranks"})
            continue
        weights = local_weights(shape, device, group)
        for num_tokens in tokens:
            if args.check:
                emit({"shape": shape, "tokens_per_gpu": num_tokens, "ep": world_size,
                      "bits_equal_single_rank": check_bits(shape, num_tokens, weights, device, group)})
            for pass_name in passes:
                baseline_ms = None
                for impl in sorted(impls, key=lambda i: i != "grouped_mm"):  # baseline first
                    row = {"shape": shape, "H": hidden, "I": inter, "E": num_experts, "K": top_k, "ep": world_size,
                           "tokens_per_gpu": num_tokens, "pass": pass_name, "impl": impl}
                    try:
                        row.update(bench_case(shape, num_tokens, pass_name, impl, weights, device, group))
                    except torch.cuda.OutOfMemoryError as err:
                        row["skipped"] = f"out of memory: {str(err).splitlines()[0]}"
                    if impl == "grouped_mm" and "ms" in row:
                        baseline_ms = row["ms"]
                    if baseline_ms and "ms" in row and impl != "grouped_mm":
                        row["speedup_vs_grouped_mm"] = round(baseline_ms / row["ms"], 3)
                    if impl == "grouped_mm" and pass_name == "fwd+bwd" and shape in BASELINE_TWO_H200_TFLOPS:
                        row["reference_two_h200_tflops_per_gpu"] = BASELINE_TWO_H200_TFLOPS[shape]
                    emit(row)
                    if use_cuda:
                        torch.cuda.empty_cache()
        del weights
    if out is not None:
        out.close()
    dist.destroy_process_group()
    return 0


def _spawned(rank, args, world_size, init_method):
    run(args, rank, world_size, init_method)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON lines output file (appended)")
    parser.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3,mixtral-8x7b", help=f"of {list(SHAPES)}")
    parser.add_argument("--tokens", default="8192", help="tokens per GPU, comma-separated")
    parser.add_argument("--passes", default="fwd,fwd+bwd")
    parser.add_argument("--impls", default="mok,grouped_mm")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--nproc", type=int, default=None,
                        help="spawn this many processes (without torchrun); default: torchrun's environment, else 1")
    parser.add_argument("--check", action="store_true", help="also compare mok's EP bits with one rank (small shapes)")
    args = parser.parse_args(argv)
    unknown = [s for s in args.shapes.split(",") if s and s not in SHAPES]
    if unknown:
        print(f"unknown shapes {unknown}; known: {list(SHAPES)}", file=sys.stderr)
        return 2
    if args.nproc is None and "RANK" in os.environ:  # torchrun
        return run(args, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://")
    nproc = args.nproc or 1
    init_method = f"file://{tempfile.mkdtemp(prefix='mok-ep-bench-')}/store"
    if nproc == 1:
        return run(args, 0, 1, init_method)
    import torch.multiprocessing as mp

    mp.spawn(_spawned, args=(args, nproc, init_method), nprocs=nproc, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
