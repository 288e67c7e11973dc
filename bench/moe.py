"""Benchmark of mok.moe against a torch._grouped_mm MoE (torchtitan style) and the per-expert loop of
transformers, in the same run, on one CUDA GPU.

    PYTHONPATH=. python bench/moe.py --out results.jsonl [--json bench/results/moe-latest.json]
        [--shapes qwen3-30b-a3b,olmoe-1b-7b] [--tokens 1,16,128,4096,16384] [--passes fwd,fwd+bwd]
        [--impls mok,grouped_mm,loop]

One JSON line per (shape, tokens, pass, impl): ms, TFLOP/s, for small T the weight-read GB/s of the
touched experts (forward) against the HBM bound, and the ratio to the grouped_mm baseline. A first
line carries the run metadata. FLOPs: forward 6*T*K*H*I (gate, up and down projections, 2*T*K*H*I
each), forward+backward 3x that (each GEMM has two backward GEMMs of the same size).
Decode (mok, forward, T <= 128) is timed twice: eager (`ms`: CUDA events around one call, so the host
work of the call counts where the GPU waits for it) and replayed from a CUDA graph (`graph_ms`), each
next to the HBM bound of the touched experts' weights (`weight_read_bound_ms`, `hbm_fraction`,
`graph_hbm_fraction`); `graph_equal_eager` says whether the replay gave the eager bits;
`graph_ms_back_to_back`: 20 replays back to back, per replay (no graph launch latency, as inside a
model-wide decode graph, but the weights a replay reads may still be in L2 from the one before). At T = 1 also
`graph_ms_per_layer`: L layers of the call, each with its own weights and the output of the one before as input, in
one CUDA graph replayed once, per layer (a layer of a model's decode graph; `graph_layers`: L, up to 8), and
`compiled_ms`: the call inside torch.compile(mode="reduce-overhead"),
timed like the eager call (what a caller without vLLM gets from torch's own CUDA graphs; `compiled_equal_eager`).
Eager and graph are timed again with programmatic dependent launch off (`ms_without_pdl`,
`graph_ms_without_pdl`; `equal_without_pdl`: the same bits), the ablation of mok/kernels/launch.py; eager once
more with every launch through Triton's own JITFunction.run instead of mok's cached launch path
(`ms_triton_launch`; `equal_triton_launch`), and once without moe_infer's launch plans, each call through the
launchers (`ms_without_plan`; `equal_without_plan`).
--json writes the summary, an object keyed by shape name: decode_t1_graph_ms, decode_t1_graph_back_to_back_ms,
decode_t1_graph_ms_per_layer, decode_t1_eager_ms, decode_t1_compiled_ms, hbm_bound_t1_ms (T = 1, forward),
fwd_tflops, fwdbwd_tflops and fwdbwd_ratio_vs_grouped_mm (grouped_mm's ms / mok's ms, forward+backward) at
T = 16384; null where that row was not run or failed.
Memory: each row has `allocated_before_gib` (what the process held when the case started: the shape's
weights, nothing of earlier cases) and `peak_gib` (the case's peak), so a run's peak is its largest case's.
Nothing of a case outlives it: its inputs, leaves and gradients are locals of bench_case, a decode graph is
reset (its memory pool released) before time_graph_ms returns, a shape's weights go before the next shape's
are made, and gc.collect() runs between cases (tests/mok/test_moe_interpret.py checks that the MoE backward
frees its buffers at once, without the cyclic collector: deepseek-v3 fwd+bwd needs that to fit).
Shapes: docs/shapes.md.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = {  # name: (H, I, E, K)
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "olmoe-1b-7b": (2048, 1024, 64, 8),
    "deepseek-v3": (7168, 2048, 256, 8),
}
HBM_BYTES_PER_S = 4.3e12
SMALL_T = 128
BACK_TO_BACK = 20  # graph replays per measurement of graph_ms_back_to_back
LARGE_T = 16384  # the T of the summary's throughput numbers


# ---------------------------------------------------------------------------------------------
# baselines (not batch-invariant; for speed only)


def _route(logits_TE, top_k):
    probs_TE = torch.softmax(logits_TE.float(), dim=-1)
    weights_TK, ids_TK = torch.topk(probs_TE, top_k, dim=-1)
    return ids_TK, weights_TK / weights_TK.sum(dim=-1, keepdim=True)


def grouped_mm_moe(x_TH, logits_TE, w13_E2IH, w2_EHI, top_k):
    """torchtitan-style: sort slots by expert, two torch._grouped_mm, index_add combine."""
    num_tokens, hidden = x_TH.shape
    num_experts, two_inter, _ = w13_E2IH.shape
    ids_TK, weights_TK = _route(logits_TE, top_k)
    flat = ids_TK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    tokens = order // top_k
    h = torch._grouped_mm(x_TH[tokens], w13_E2IH.transpose(-2, -1), offs=offsets)
    act = F.silu(h[:, :two_inter // 2]) * h[:, two_inter // 2:]
    y = torch._grouped_mm(act, w2_EHI.transpose(-2, -1), offs=offsets)
    y = y * weights_TK.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros(num_tokens, hidden, device=x_TH.device, dtype=x_TH.dtype).index_add(0, tokens, y)


def loop_moe(x_TH, logits_TE, w13_E2IH, w2_EHI, top_k):
    """transformers-style: for each hit expert, gather its tokens, two matmuls, index_add."""
    ids_TK, weights_TK = _route(logits_TE, top_k)
    inter = w13_E2IH.shape[1] // 2
    out = torch.zeros_like(x_TH)
    hit = torch.unique(ids_TK).tolist()
    for e in hit:
        token_idx, k_idx = torch.where(ids_TK == e)
        h = x_TH[token_idx] @ w13_E2IH[e].t()
        y = (F.silu(h[:, :inter]) * h[:, inter:]) @ w2_EHI[e].t()
        out = out.index_add(0, token_idx, y * weights_TK[token_idx, k_idx, None].to(y.dtype))
    return out


def mok_moe(x_TH, logits_TE, w13_E2IH, w2_EHI, top_k):
    import mok

    return mok.moe(x_TH, logits_TE, w13_E2IH, w2_EHI, top_k)


IMPLS = {"mok": mok_moe, "grouped_mm": grouped_mm_moe, "loop": loop_moe}


# ---------------------------------------------------------------------------------------------
# timing


def time_ms(fn, min_iters=5, max_iters=100, budget_s=1.0) -> float:
    """Median of per-iteration CUDA-event times after warm-up. No gc.collect() between timed calls: it evicts
    the host's caches, so the next call's host work (all of an eager decode call, a graph's launch) runs 2-3x
    slower in the timed region."""
    for _ in range(2):
        fn()
        gc.collect()
    torch.cuda.synchronize()
    times = []
    start_wall = time.perf_counter()
    while len(times) < max_iters and (len(times) < min_iters or time.perf_counter() - start_wall < budget_s):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def bench_case(shape, num_tokens, pass_name, impl, weights, loop_budget_s):
    hidden, inter, num_experts, top_k = SHAPES[shape]
    w13, w2 = weights
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, device="cuda", generator=gen).bfloat16()
    logits = torch.randn(num_tokens, num_experts, device="cuda", generator=gen)
    fn = IMPLS[impl]
    if pass_name == "fwd":
        def run():
            with torch.no_grad():
                return fn(x, logits, w13, w2, top_k)
    else:
        leaves = [t.detach().requires_grad_() for t in (x, logits, w13, w2)]
        grad_out = torch.randn(num_tokens, hidden, device="cuda", generator=gen).bfloat16()

        def run():
            for t in leaves:
                t.grad = None
            fn(*leaves, top_k).backward(grad_out)
    if impl == "loop":
        # one probe call: the per-expert loop is skipped where it would eat the device time
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        gc.collect()
        if time.perf_counter() - t0 > loop_budget_s:
            return {"skipped": f"one call took more than {loop_budget_s} s"}
    ms = time_ms(run)
    flops = 6 * num_tokens * top_k * hidden * inter * (3 if pass_name == "fwd+bwd" else 1)
    row = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 2)}
    if pass_name == "fwd" and num_tokens <= SMALL_T:
        touched = int(torch.unique(_route(logits, top_k)[0]).numel())
        weight_bytes = touched * 3 * hidden * inter * w13.element_size()
        row["weight_gb_s"] = round(weight_bytes / ms / 1e6, 1)
        row["hbm_fraction"] = round(weight_bytes / ms / 1e-3 / HBM_BYTES_PER_S, 3)
        row["weight_read_bound_ms"] = round(weight_bytes / HBM_BYTES_PER_S * 1e3, 4)
        if impl == "mok":  # the baselines synchronise (bincount, unique): they cannot be captured
            try:
                graph_ms, equal = time_graph_ms(run)
                row["graph_ms"] = round(graph_ms, 4)
                row["graph_hbm_fraction"] = round(weight_bytes / graph_ms / 1e-3 / HBM_BYTES_PER_S, 3)
                row["graph_equal_eager"] = equal
                row["graph_ms_back_to_back"] = round(time_graph_ms(run, BACK_TO_BACK)[0], 4)
                row.update(without_pdl(run))
                row.update(with_triton_launch(run))
                row.update(without_plans(run))
            except RuntimeError as err:
                row["graph_error"] = str(err).splitlines()[0][:300]
            if num_tokens == 1:
                row.update(layers_in_one_graph(x, logits, w13, w2, top_k))
                row.update(compiled_reduce_overhead(x, logits, w13, w2, top_k, run))
    return row


def layers_in_one_graph(x, logits, w13, w2, top_k, max_layers: int = 8, max_bytes: float = 48 * 2**30) -> dict:
    """The decode call as a layer of a model's decode graph (vLLM's): L layers, each with its own copy of the
    weights (so no layer finds the weights it reads in L2, as a replayed single layer may), each layer's output the
    next layer's input, captured in one CUDA graph and replayed once per timing: `graph_ms_per_layer` (the replay's
    ms / L: one graph launch shared by L layers), `graph_layers` (L: at most max_layers, with the copies' weights at
    most max_bytes) and whether the replay gives the eager chain's bits (`graph_layers_equal_eager`)."""
    import mok

    layers = max(2, min(max_layers, int(max_bytes // (w13.nbytes + w2.nbytes))))
    weights = [(w13, w2)] + [(w13.clone(), w2.clone()) for _ in range(layers - 1)]

    def chain(x_TH):
        with torch.no_grad():
            for layer_w13, layer_w2 in weights:
                x_TH = mok.moe(x_TH, logits, layer_w13, layer_w2, top_k)
        return x_TH

    eager = chain(x)
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    static_out = None
    try:
        with torch.cuda.graph(graph):
            static_out = chain(static_x)
        ms = time_ms(graph.replay)
        graph.replay()
        torch.cuda.synchronize()
        return {"graph_ms_per_layer": round(ms / layers, 4), "graph_layers": layers,
                "graph_layers_equal_eager": bool(torch.equal(static_out, eager))}
    finally:
        del static_out
        torch.cuda.synchronize()
        with contextlib.suppress(RuntimeError):
            graph.reset()


def compiled_reduce_overhead(x, logits, w13, w2, top_k, run) -> dict:
    """The decode call as a user without vLLM makes it graph-fast: mok.moe inside torch.compile(fullgraph=True,
    mode="reduce-overhead") (inductor, replayed from CUDA graphs by torch's cudagraph trees), called like the eager
    call (`compiled_ms`: CUDA events around one call, so its host work counts) and whether it gives the eager bits
    (`compiled_equal_eager`)."""
    import mok

    eager = run()

    class Experts(torch.nn.Module):
        """The weights as a model holds them (parameters: static inputs of the CUDA graphs; plain tensors would be
        copied into the graphs' input buffers at every call)."""

        def __init__(self):
            super().__init__()
            self.w13 = torch.nn.Parameter(w13, requires_grad=False)
            self.w2 = torch.nn.Parameter(w2, requires_grad=False)

        def forward(self, x_TH, logits_TE):
            return mok.moe(x_TH, logits_TE, self.w13, self.w2, top_k)

    decode = torch.compile(Experts(), fullgraph=True, mode="reduce-overhead")
    try:
        with torch.no_grad():
            for _ in range(3):  # compile, record, then replays
                decode(x, logits)

            def call():
                return decode(x, logits)

            return {"compiled_ms": round(time_ms(call), 4),
                    "compiled_equal_eager": bool(torch.equal(call().clone(), eager))}
    except Exception as err:  # a compile failure is a result of this row, not of the run
        return {"compiled_error": f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"}
    finally:
        torch.compiler.reset()  # drops the compiled function and its CUDA graphs before the next case


def without_pdl(run) -> dict:
    """The same decode call with programmatic dependent launch off (mok/kernels/launch.py), same run: eager and
    graph ms, and whether its output has the bits of the call with PDL."""
    from mok.kernels import launch

    with_pdl = run()  # the decode rows' run() is a forward under no_grad
    saved, launch.PDL_ENABLED = launch.PDL_ENABLED, False
    try:
        result = {"ms_without_pdl": round(time_ms(run), 4), "graph_ms_without_pdl": round(time_graph_ms(run)[0], 4),
                  "graph_ms_back_to_back_without_pdl": round(time_graph_ms(run, BACK_TO_BACK)[0], 4),
                  "equal_without_pdl": bool(torch.equal(run(), with_pdl))}
    finally:
        launch.PDL_ENABLED = saved
    return result


def with_triton_launch(run) -> dict:
    """The eager decode call with mok's cached launch path off (mok/kernels/launch.py: every kernel through
    Triton's JITFunction.run), same run: its ms and whether its output has the bits of the cached launches."""
    from mok.kernels import launch

    cached = run()
    saved, launch.CACHED_LAUNCH_ENABLED = launch.CACHED_LAUNCH_ENABLED, False
    try:
        return {"ms_triton_launch": round(time_ms(run), 4), "equal_triton_launch": bool(torch.equal(run(), cached))}
    finally:
        launch.CACHED_LAUNCH_ENABLED = saved


def without_plans(run) -> dict:
    """The eager decode call with moe_infer's launch plans off (mok/kernels/moe/layer.py decode_plans: every call
    through the launchers), same run: its ms and whether its output has the bits of the planned call."""
    from mok.kernels.moe import layer

    planned = run()
    saved, layer.decode_plans.capacity = layer.decode_plans.capacity, 0
    try:
        return {"ms_without_plan": round(time_ms(run), 4), "equal_without_plan": bool(torch.equal(run(), planned))}
    finally:
        layer.decode_plans.capacity = saved


def time_graph_ms(run, replays: int = 1) -> tuple[float, bool]:
    """(median ms per replay of run() captured in a CUDA graph, whether the replay gives run()'s eager bits).
    replays: replays timed back to back per measurement (the ms is divided by it). One replay between two
    events also counts the graph's launch latency, which a model-wide decode graph pays once per step, not per
    layer; back-to-back replays count the kernels and the gaps between them, close to the layer's share of such a
    graph (there, PDL also overlaps the layer's first kernel with the one before it; here graphs do not overlap).
    The graph is reset before returning (or raising): its private memory pool goes back to the allocator at
    once, whatever still refers to the graph object."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture (the CUDA-graph recipe)
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    static_out = None
    try:
        with torch.cuda.graph(graph):
            static_out = run()
        def replay():
            for _ in range(replays):
                graph.replay()

        ms = time_ms(replay) / replays
        torch.cuda.synchronize()
        equal = bool(torch.equal(static_out, run()))
    finally:
        del static_out  # the pool's blocks must be free before the reset releases it
        torch.cuda.synchronize()
        with contextlib.suppress(RuntimeError):  # (after a failed capture: keep that error)
            graph.reset()
    return ms, equal


def summary(rows: list[dict], shapes: list[str]) -> dict:
    """The --json summary (see the module docstring) from the rows of this run."""

    def find(shape, tokens, pass_name, impl="mok"):
        for row in rows:
            if (row.get("shape"), row.get("tokens"), row.get("pass"), row.get("impl")) == (shape, tokens, pass_name,
                                                                                             impl):
                return row
        return {}

    result = {}
    for shape in shapes:
        decode, fwd, fwd_bwd = find(shape, 1, "fwd"), find(shape, LARGE_T, "fwd"), find(shape, LARGE_T, "fwd+bwd")
        result[shape] = {
            "decode_t1_graph_ms": decode.get("graph_ms"),
            "decode_t1_graph_back_to_back_ms": decode.get("graph_ms_back_to_back"),
            "decode_t1_graph_ms_per_layer": decode.get("graph_ms_per_layer"),
            "decode_t1_eager_ms": decode.get("ms"),
            "decode_t1_compiled_ms": decode.get("compiled_ms"),
            "hbm_bound_t1_ms": decode.get("weight_read_bound_ms"),
            "fwd_tflops": fwd.get("tflops"),
            "fwdbwd_tflops": fwd_bwd.get("tflops"),
            "fwdbwd_ratio_vs_grouped_mm": fwd_bwd.get("speedup_vs_grouped_mm"),
        }
    return result


def bench_shape(shape, tokens, passes, impls, loop_budget_s, emit) -> None:
    """Every (tokens, pass, impl) row of one shape, emitted as it is measured. The shape's weights are locals
    here: they go when this returns."""
    hidden, inter, num_experts, top_k = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden ** 0.5).bfloat16()
    w2 = (torch.randn(num_experts, hidden, inter, device="cuda", generator=gen) / inter ** 0.5).bfloat16()
    for num_tokens in tokens:
        for pass_name in passes:
            baseline_ms = None
            for impl in sorted(impls, key=lambda i: i != "grouped_mm"):  # baseline first
                row = {"shape": shape, "H": hidden, "I": inter, "E": num_experts, "K": top_k,
                       "tokens": num_tokens, "pass": pass_name, "impl": impl}
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                try:
                    row.update(bench_case(shape, num_tokens, pass_name, impl, (w13, w2), loop_budget_s))
                except torch.cuda.OutOfMemoryError as err:
                    row["skipped"] = f"out of memory: {str(err).splitlines()[0]}"
                except RuntimeError as err:
                    row["error"] = str(err).splitlines()[0][:300]
                gc.collect()  # (an exception's frames, and anything else of the case in a cycle)
                torch.cuda.synchronize()
                row["allocated_before_gib"] = round(before / 2**30, 2)
                row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                row["left_after_gib"] = round((torch.cuda.memory_allocated() - before) / 2**30, 3)
                torch.cuda.empty_cache()
                if impl == "grouped_mm" and "ms" in row:
                    baseline_ms = row["ms"]
                if baseline_ms and "ms" in row:
                    row["speedup_vs_grouped_mm"] = round(baseline_ms / row["ms"], 3)
                emit(row)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON lines output file")
    parser.add_argument("--json", default=None, help="write the summary object here (bench/results/moe-latest.json)")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--tokens", default="1,16,128,4096,16384")
    parser.add_argument("--passes", default="fwd,fwd+bwd")
    parser.add_argument("--impls", default="mok,grouped_mm,loop")
    parser.add_argument("--loop-budget-s", type=float, default=0.5, help="skip the loop baseline above this per call")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/moe.py needs a CUDA GPU", file=sys.stderr)
        return 2
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        print(f"unknown shapes {unknown}; known: {list(SHAPES)}", file=sys.stderr)
        return 2
    tokens = [int(t) for t in args.tokens.split(",") if t]
    passes = [p for p in args.passes.split(",") if p]
    impls = [i for i in args.impls.split(",") if i]
    import triton

    meta = {"kind": "meta", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda}
    rows = []
    gc.freeze()  # the objects of the imports never become garbage: the gc.collect() after each call skips them
    with open(args.out, "a") as out:
        out.write(json.dumps(meta) + "\n")
        print(json.dumps(meta), flush=True)

        def emit(row):
            rows.append(row)
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(json.dumps(row), flush=True)

        for shape in shapes:
            bench_shape(shape, tokens, passes, impls, args.loop_budget_s, emit)
            gc.collect()
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary(rows, shapes), f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
