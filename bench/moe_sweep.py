"""Config sweep of the MoE Triton kernels (mok/kernels/moe/) on one CUDA GPU, in one bounded run.

    PYTHONPATH=. python3 bench/moe_sweep.py --out $OUT/sweep.jsonl [--budget-s 300]
        [--shapes qwen3-30b-a3b,deepseek-v3,olmoe-1b-7b,mixtral-8x7b] [--tokens 16384] [--decode-tokens 1,64,256]
        [--kernels gemm1,gemm2,bwd_act,bwd_dx,weight_grad]

Backward only (no decode sweep), e.g.:
    PYTHONPATH=. python3 bench/moe_sweep.py --out $OUT/sweep.jsonl --shapes mixtral-8x7b,deepseek-v3 \
        --kernels bwd_act,bwd_dx,weight_grad --budget-s 200

For each shape at T tokens, each kernel (gemm1, gemm2, bwd_act, bwd_dx, weight_grad = both weight
gradients) runs alone on the same inputs under candidate configs (tile shapes, warps, stages,
GROUP_M, BLOCK_K, TMA on/off; bench/moe_sweep_candidates.py). Every candidate's outputs must be bitwise
identical to those of the config mok uses today (the tile-config invariance that lets the config follow T); a
candidate that differs is reported ("mismatch") and never chosen. Then the whole layer (forward, forward+backward)
runs with the chosen configs next to today's and a torch._grouped_mm baseline, and the decode
config is swept end to end at --decode-tokens (routing and the experts, the sampler's moe_infer path), replayed from
a CUDA graph, with and without programmatic dependent launch and GEMM 2's L2 prefetch (mok/kernels/launch.py).
With backward kernels swept, each stage of moe_backward (combine backward, bwd_act, bwd_dx, the d hidden
combine, both weight gradients, layout copies) is timed alone under today's and the best configs
("bwd_stage" rows). One JSON line per measurement goes to --out; the last lines, also printed, hold the best config per
(shape, kernel) and a CONFIGS dict to paste into mok/kernels/moe/configs.py.
Shapes: docs/shapes.md.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import pprint
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe import SHAPES, grouped_mm_moe, time_graph_ms  # noqa: E402  (bench/moe.py)
from moe import time_ms as _cuda_time_ms  # noqa: E402
from moe_sweep_candidates import (  # noqa: E402  (bench/moe_sweep_candidates.py: what the sweep tries)
    BACKWARD_KERNELS,
    CANDIDATES,
    DECODE_CANDIDATES,
    KERNELS,
    MOVE_CANDIDATES,
)

DEVICE = "cuda"
LAYER_ROUNDS = 3  # the whole layer under today's and the best configs, alternately


def time_ms(fn, min_iters=5, max_iters=100, budget_s=1.0) -> float:
    """CUDA-event median (bench/moe.py); wall clock in --smoke runs on the CPU."""
    if DEVICE == "cuda":
        return _cuda_time_ms(fn, min_iters, max_iters, budget_s)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


class Problem:
    """One shape at T tokens: inputs, the schedule, and every kernel's inputs from today's configs."""

    def __init__(self, shape: str, num_tokens: int):
        from mok.kernels.moe import combine, configs, layer
        from mok.kernels.moe.schedule import Schedule

        hidden, inter, num_experts, top_k = SHAPES[shape]
        self.dims = (num_tokens, hidden, inter, num_experts, top_k)
        gen = torch.Generator(device=DEVICE).manual_seed(0)
        self.w13 = (torch.randn(num_experts, 2 * inter, hidden, device=DEVICE, generator=gen)
                    / hidden ** 0.5).bfloat16()
        self.w2 = (torch.randn(num_experts, hidden, inter, device=DEVICE, generator=gen) / inter ** 0.5).bfloat16()
        self.x = torch.randn(num_tokens, hidden, device=DEVICE, generator=gen).bfloat16()
        self.logits = torch.randn(num_tokens, num_experts, device=DEVICE, generator=gen)
        self.grad_out = torch.randn(num_tokens, hidden, device=DEVICE, generator=gen).bfloat16()
        self.ids, self.weights, _ = layer.route(self.logits, top_k, True)
        self.size_class = configs.size_class(self.ids.numel(), num_experts)
        self.default = copy.deepcopy(configs.pick_configs(self.ids.numel(), num_experts, hidden=hidden))
        self.schedule = Schedule(self.ids, num_experts)
        # saved tensors of the forward and the combine backward, from today's configs
        _, self.gate_up, self.act, self.y, *_ = layer.moe_forward(
            self.x, self.w13, self.w2, self.ids, self.weights, True, self.default)
        self.grad_y, _ = combine.launch_combine_backward(self.grad_out, self.y, self.weights, top_k)
        order = self.schedule.sorted_slots_N.long()
        self.grad_y_sorted = self.grad_y.index_select(0, order)  # d y in schedule order (SORTED_DY)
        self.token_of_position = order // top_k
        self.grad_gate_up = self.run("bwd_act", self.default["bwd_act"])[0]
        self.outputs: dict[str, list[torch.Tensor]] = {}

    def backward_stages(self, cfg: dict):
        """moe_backward's stages (mok.kernels.moe.layer.BackwardStages, none run yet) after a forward under cfg."""
        from mok.kernels.moe import layer

        saved = layer.moe_forward(self.x, self.w13, self.w2, self.ids, self.weights, True, cfg)
        return layer.BackwardStages(self.grad_out, self.x, self.w13, self.w2, self.ids, self.weights, *saved[1:],
                                    configs=cfg)

    def run(self, kernel: str, cfg: dict, outputs: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """One launch (two for weight_grad) of `kernel` under `cfg`; outputs are reused when given."""
        from mok.kernels.moe import grouped_gemm as k

        num_tokens, hidden, inter, num_experts, top_k = self.dims
        num_slots = num_tokens * top_k
        dev, dt = DEVICE, torch.bfloat16
        s, w13, w2 = self.schedule, self.w13, self.w2
        if kernel == "gemm1":
            return list(k.launch_gemm1(self.x, w13, s, top_k, True, cfg))
        if kernel == "gemm2":
            y = outputs[0] if outputs else torch.empty(num_slots, hidden, device=dev, dtype=dt)
            k.launch_gemm2(self.act, w2, y, s, top_k, cfg)
            return [y]
        sorted_dy = bool(cfg.get("SORTED_DY", 0))
        grad_y, dy_rows = (self.grad_y_sorted, k.ROWS_POSITION) if sorted_dy else (self.grad_y, k.ROWS_SLOT)
        if kernel == "bwd_act":
            g = outputs[0] if outputs else torch.empty(num_slots, 2 * inter, device=dev, dtype=dt)
            k.launch_bwd_act(grad_y, w2, self.gate_up, g, s, top_k, cfg, dy_rows=dy_rows)
            return [g]
        if kernel == "bwd_dx":
            g = outputs[0] if outputs else torch.empty(num_slots, hidden, device=dev, dtype=torch.float32)
            k.launch_bwd_dx(self.grad_gate_up, w13, g, s, top_k, cfg)
            return [g]
        if kernel == "weight_grad":
            gw2, gw13 = outputs if outputs else (torch.empty_like(w2), torch.empty_like(w13))
            k.launch_weight_grad_w2(grad_y, self.act, gw2, s, top_k, cfg, dy_rows=dy_rows)
            if cfg.get("SORTED_X", 0):  # the gather is part of the candidate's cost
                x_sorted = self.x.index_select(0, self.token_of_position)
                k.launch_weight_grad_w13(self.grad_gate_up, self.x, gw13, s, top_k, cfg, x_sorted)
            else:
                k.launch_weight_grad_w13(self.grad_gate_up, self.x, gw13, s, top_k, cfg)
            return [gw2, gw13]
        raise KeyError(kernel)


def _key(cfg: dict) -> str:
    return json.dumps(cfg, sort_keys=True)


def _error_text(err: Exception) -> str:
    """A failed candidate's row: the exception's type and its message's first line."""
    return f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"


def sweep_shape(shape, num_tokens, deadline, emit, kernels=KERNELS) -> dict:
    """-> {kernel: {config key: ms}} for the candidates that matched today's bits."""
    problem = Problem(shape, num_tokens)
    timings: dict[str, dict[str, float]] = {}
    kernels_left = list(kernels)
    for kernel in kernels:
        kernels_left.remove(kernel)
        kernel_deadline = time.perf_counter() + (deadline - time.perf_counter()) / (len(kernels_left) + 1)
        reference = [t.clone() for t in problem.run(kernel, problem.default[kernel])]
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        timings[kernel] = {}
        candidates = [problem.default[kernel]] + [c for c in CANDIDATES[kernel]
                                                  if _key(c) != _key(problem.default[kernel])]
        for cfg in candidates:
            row = {"kind": "kernel", "shape": shape, "tokens": num_tokens, "class": problem.size_class,
                   "kernel": kernel, "config": cfg}
            if time.perf_counter() > kernel_deadline and timings[kernel]:
                row["skipped"] = "time budget"
                emit(row)
                continue
            try:
                got = problem.run(kernel, cfg)
                if not all(torch.equal(a, b) for a, b in zip(got, reference)):
                    row["mismatch"] = "outputs differ from today's config: NOT tile-invariant, never use"
                else:
                    scratch = None if kernel == "gemm1" else got  # gemm1 allocates its own outputs
                    ms = time_ms(lambda: problem.run(kernel, cfg, scratch), min_iters=3, max_iters=20, budget_s=0.3)
                    row["ms"] = round(ms, 4)
                    timings[kernel][_key(cfg)] = ms
            except Exception as err:  # compile failures (resources, API) are data, not fatal
                row["error"] = _error_text(err)
            got = scratch = None
            emit(row)
        reference = None
        torch.cuda.empty_cache()
    if any(kernel in BACKWARD_KERNELS for kernel in kernels):
        sweep_moves(problem, shape, num_tokens, emit)
    best = {kernel: json.loads(min(t, key=t.get)) for kernel, t in timings.items() if t}
    # whole layer: today's configs, the best ones, and the grouped_mm baseline; the backward stage by stage
    if time.perf_counter() < deadline + 30:
        try:
            if any(kernel in BACKWARD_KERNELS for kernel in kernels):
                for label, cfg in (("today", problem.default), ("best", dict(problem.default, **best))):
                    backward_breakdown(problem, shape, num_tokens, label, cfg, emit)
            layer_rows(problem, shape, num_tokens, best, emit)
        except Exception as err:  # e.g. the baseline running out of memory: the sweep result stands
            emit({"kind": "error", "shape": shape, "error": f"layer timing: {type(err).__name__}: {str(err)[:300]}"})
    problem = None
    torch.cuda.empty_cache()
    return timings


def sweep_moves(problem, shape, num_tokens, emit):
    """Each MOVE_CANDIDATES value: the stage alone under today's configs, its outputs checked against the first
    value's ("move" rows)."""
    from mok.kernels.moe import configs

    backward = problem.backward_stages(problem.default)
    stages = dict(backward.stages)
    for stage, setting, values, outputs in MOVE_CANDIDATES:
        today, reference = getattr(configs, setting), None
        try:
            for name, run in backward.stages:  # the stages before this one, once
                if name == stage:
                    break
                run()
            for value in values:
                setattr(configs, setting, value)
                stages[stage]()
                got = [getattr(backward, name).clone() for name in outputs]
                reference = reference or got
                row = {"kind": "move", "shape": shape, "tokens": num_tokens, "stage": stage, setting: value,
                       "ms": round(time_ms(stages[stage], min_iters=5, max_iters=30, budget_s=0.3), 4)}
                if not all(torch.equal(a, b) for a, b in zip(got, reference)):
                    row["mismatch"] = f"outputs differ from {setting} = {values[0]}"
                emit(row)
        finally:
            setattr(configs, setting, today)
    backward = None


def backward_breakdown(problem, shape, num_tokens, label, cfg, emit):
    """Each stage of moe_backward (mok.kernels.moe.layer.BackwardStages) timed alone under `cfg`, after one
    full pass; the stage rows and their sum (launch gaps excluded) go to `emit`."""
    backward = problem.backward_stages(cfg)
    for _, run in backward.stages:
        run()
    total = 0.0
    for name, run in backward.stages:
        ms = time_ms(run, min_iters=3, max_iters=10, budget_s=0.2)
        total += ms
        emit({"kind": "bwd_stage", "shape": shape, "tokens": num_tokens, "configs": label, "stage": name,
              "ms": round(ms, 4)})
    emit({"kind": "bwd_stage", "shape": shape, "tokens": num_tokens, "configs": label, "stage": "sum",
          "ms": round(total, 4), "config": {n: c for n, c in cfg.items() if n in BACKWARD_KERNELS}})
    backward = None


def layer_rows(problem, shape, num_tokens, best, emit):
    from mok.kernels.moe import layer as k
    top_k = problem.dims[4]
    args = (problem.x, problem.w13, problem.w2, problem.ids, problem.weights)
    rounds: dict[tuple[str, str], list[float]] = {}
    for _ in range(LAYER_ROUNDS):  # today and best alternate: drifts of the GPU's clocks hit both alike
        for label, cfg in (("today", problem.default), ("best", dict(problem.default, **best))):
            def fwd():
                k.moe_forward(*args, False, cfg)

            def fwd_bwd():
                saved = k.moe_forward(*args, True, cfg)
                k.moe_backward(problem.grad_out, *args, *saved[1:], configs=cfg)

            for pass_name, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                ms = time_ms(fn, min_iters=5, max_iters=20, budget_s=0.5)
                rounds.setdefault((label, pass_name), []).append(round(ms, 4))
    for (label, pass_name), times in rounds.items():
        emit({"kind": "layer", "shape": shape, "tokens": num_tokens, "configs": label, "pass": pass_name,
              "ms": sorted(times)[len(times) // 2], "rounds_ms": times})
    with torch.no_grad():
        emit({"kind": "layer", "shape": shape, "tokens": num_tokens, "configs": "grouped_mm baseline", "pass": "fwd",
              "ms": round(time_ms(lambda: grouped_mm_moe(problem.x, problem.logits, problem.w13, problem.w2, top_k),
                                  min_iters=3, max_iters=10, budget_s=0.5), 4)})
    leaves = [t.detach().requires_grad_() for t in (problem.x, problem.logits, problem.w13, problem.w2)]

    def baseline_bwd():
        for t in leaves:
            t.grad = None
        grouped_mm_moe(*leaves, top_k).backward(problem.grad_out)

    emit({"kind": "layer", "shape": shape, "tokens": num_tokens, "configs": "grouped_mm baseline", "pass": "fwd+bwd",
          "ms": round(time_ms(baseline_bwd, min_iters=3, max_iters=10, budget_s=0.5), 4)})
    leaves = None


def sweep_decode(shape, num_tokens, emit) -> dict:
    """End-to-end decode forward (moe_infer): each decode override, PDL off, and today's configs again last (the
    spread of the first and last "today" rows is the run's noise)."""
    from mok.kernels import launch
    from mok.kernels.moe import configs, layer

    hidden, inter, num_experts, top_k = SHAPES[shape]
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device=DEVICE, generator=gen) / hidden ** 0.5).bfloat16()
    w2 = (torch.randn(num_experts, hidden, inter, device=DEVICE, generator=gen) / inter ** 0.5).bfloat16()
    x = torch.randn(num_tokens, hidden, device=DEVICE, generator=gen).bfloat16()
    logits = torch.randn(num_tokens, num_experts, device=DEVICE, generator=gen)
    size_class = configs.size_class(num_tokens * top_k, num_experts)
    default = copy.deepcopy(configs.CONFIGS[size_class])

    def forward(cfg):  # the sampler's decode path: routing, then the experts (scanning the routes when small)
        return layer.moe_infer(x, logits, w13, w2, None, None, top_k, True, cfg)

    reference = forward(default)
    results = {}
    variants = [("today", default)]
    override_of = dict(DECODE_CANDIDATES, today={})
    for label, override in DECODE_CANDIDATES:
        if override == "tma":
            override = {name: dict(c, TMA=1) for name, c in default.items() if name != "weight_grad"}
        variants.append((label, default if override == "no pdl" else dict(default, **override)))
    for label, cfg in variants:
        row = {"kind": "decode", "shape": shape, "tokens": num_tokens, "class": size_class, "variant": label,
               "config": {n: c for n, c in cfg.items() if c != default.get(n)}}
        saved_pdl = launch.PDL_ENABLED
        launch.PDL_ENABLED = saved_pdl and override_of[label] != "no pdl"
        try:
            if not torch.equal(forward(cfg), reference):
                row["mismatch"] = "output differs from today's config: NOT tile-invariant, never use"
            else:
                # replayed from a CUDA graph, 20 replays back to back (vLLM's decode): kernel time and gaps
                row["ms"] = round(time_graph_ms(lambda: forward(cfg), replays=20)[0], 4) if DEVICE == "cuda" else \
                    round(time_ms(lambda: forward(cfg)), 4)
                results[label] = (row["ms"], row["config"])
        except Exception as err:
            row["error"] = _error_text(err)
        finally:
            launch.PDL_ENABLED = saved_pdl
        emit(row)
    emit(dict({"kind": "decode", "shape": shape, "tokens": num_tokens, "class": size_class,
               "variant": "vllm fused_experts"}, **vllm_fused_moe_ms(x, logits, w13, w2, top_k)))
    return results


def vllm_fused_moe_ms(x_TH, logits_TE, w13_E2IH, w2_EHI, top_k: int) -> dict:
    """{"ms": ...} of vLLM's own Triton MoE on the same inputs (fused_topk, then fused_experts with vLLM's tuned
    config table for this GPU and shape), what stock vLLM runs for this layer, replayed from a CUDA graph like the
    rows above; {"error": ...} where vLLM does not import (it does with the GPU bundle, docs/development.md)."""
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts, fused_topk
    except Exception as err:
        return {"error": f"vLLM's fused MoE not importable: {type(err).__name__}: {str(err)[:200]}"}

    def forward():
        weights_TK, ids_TK, _ = fused_topk(x_TH, logits_TE, top_k, renormalize=True)
        return fused_experts(x_TH, w13_E2IH, w2_EHI, weights_TK, ids_TK)

    try:
        return {"ms": round(time_graph_ms(forward, replays=20)[0], 4)} if DEVICE == "cuda" else {"error": "no GPU"}
    except Exception as err:
        return {"error": _error_text(err)}


def aggregate(per_shape: dict[str, dict], shapes_of_class: dict[str, list[str]], kernel_names=KERNELS) -> dict:
    """Per class and kernel: the candidate with the least geometric mean of (its ms / the shape's
    best ms) over the class's shapes, among candidates measured on all of them."""
    from mok.kernels.moe.configs import CONFIGS

    chosen = {}
    for size_class, shapes in shapes_of_class.items():
        entry = copy.deepcopy(CONFIGS[size_class])
        for kernel in kernel_names:
            tables = [per_shape[s][kernel] for s in shapes if per_shape[s].get(kernel)]
            if not tables:
                continue
            common = set.intersection(*(set(t) for t in tables))
            if not common:
                continue

            def score(key):
                return sum(math.log(t[key] / min(t.values())) for t in tables)

            entry[kernel] = json.loads(min(sorted(common), key=score))
        chosen[size_class] = entry
    return chosen


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON lines output file")
    parser.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3,olmoe-1b-7b,mixtral-8x7b")
    parser.add_argument("--tokens", type=int, default=16384, help="0: the decode sweep only")
    parser.add_argument("--decode-tokens", default="1",
                        help="decode sweep token counts, comma-separated (1,64,256: sampler batches); 0: none")
    parser.add_argument("--kernels", default=",".join(KERNELS),
                        help="kernels to sweep (e.g. bwd_act,bwd_dx,weight_grad: backward only, no decode sweep)")
    parser.add_argument("--budget-s", type=float, default=300.0, help="wall-clock budget of the whole sweep")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU self-check of this script under TRITON_INTERPRET=1: tiny shape, two candidates each")
    args = parser.parse_args(argv)
    if args.smoke:
        global DEVICE
        DEVICE = "cpu"
        SHAPES.clear()
        SHAPES["tiny"] = (64, 32, 4, 2)
        args.shapes, args.tokens = "tiny", 40
        for kernel in CANDIDATES:
            CANDIDATES[kernel] = [dict(c, BLOCK_M=16, BLOCK_N=32)
                                  for c in CANDIDATES[kernel][:2] + CANDIDATES[kernel][-1:]]
        del DECODE_CANDIDATES[2:-3]
    elif not torch.cuda.is_available():
        print("bench/moe_sweep.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    from mok.kernels.moe import configs as kernel_configs

    start = time.perf_counter()
    shapes = [s for s in args.shapes.split(",") if s]
    kernel_names = tuple(name for name in KERNELS if name in args.kernels.split(","))
    unknown = set(args.kernels.split(",")) - set(KERNELS)
    if unknown or not kernel_names:
        print(f"unknown --kernels {sorted(unknown)}; choose from {KERNELS}", file=sys.stderr)
        return 2
    if "gemm1" not in kernel_names and "gemm2" not in kernel_names:
        args.decode_tokens = "0"  # the decode sweep tunes the forward only
    decode_tokens = [int(t) for t in args.decode_tokens.split(",") if int(t) > 0]
    out = open(args.out, "a")

    def emit(row):
        out.write(json.dumps(row) + "\n")
        out.flush()
        print(json.dumps(row), flush=True)

    emit({"kind": "meta", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
          "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke)", "torch": torch.__version__,
          "triton": triton.__version__,
          "tokens": args.tokens, "budget_s": args.budget_s, "shapes": shapes, "kernels": kernel_names})
    # decode first (cheap), then the large shapes share what is left
    decode = {}
    for shape in shapes:
        for tokens in decode_tokens:
            decode[shape, tokens] = sweep_decode(shape, tokens, emit)
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    per_shape, shapes_of_class = {}, {}
    deadline_total = start + args.budget_s
    for i, shape in enumerate(shapes if args.tokens > 0 else ()):
        # the first shape pays the compiles (later shapes hit Triton's in-memory cache): double share
        share = (2 if i == 0 else 1) / (len(shapes) - i + (1 if i == 0 else 0))
        deadline = time.perf_counter() + (deadline_total - time.perf_counter()) * share
        hidden, inter, num_experts, top_k = SHAPES[shape]
        size_class = kernel_configs.size_class(args.tokens * top_k, num_experts)
        shapes_of_class.setdefault(size_class, []).append(shape)
        try:
            per_shape[shape] = sweep_shape(shape, args.tokens, deadline, emit, kernel_names)
        except torch.cuda.OutOfMemoryError as err:
            emit({"kind": "error", "shape": shape, "error": f"out of memory: {str(err).splitlines()[0]}"})
            per_shape[shape] = {}
        torch.cuda.empty_cache()
        for kernel, table in per_shape[shape].items():
            best_key = min(table, key=table.get)
            today = table.get(_key(kernel_configs.CONFIGS[size_class][kernel]))
            emit({"kind": "best", "shape": shape, "class": size_class, "kernel": kernel, "config": json.loads(best_key),
                  "ms": round(table[best_key], 4), "today_ms": round(today, 4) if today else None})
    chosen = aggregate(per_shape, shapes_of_class, kernel_names)
    decode_votes = {}
    for (shape, tokens), results in decode.items():
        if results:
            label = min(results, key=lambda v: results[v][0])
            emit({"kind": "best_decode", "shape": shape, "tokens": tokens, "variant": label, "ms": results[label][0],
                  "today_ms": results.get("today", (None,))[0], "config": results[label][1]})
            decode_votes[f"{shape} T={tokens}"] = label
    configs = copy.deepcopy(kernel_configs.CONFIGS)
    configs.update(chosen)
    emit({"kind": "configs", "CONFIGS": configs, "decode_best_per_shape": decode_votes,
          "elapsed_s": round(time.perf_counter() - start, 1)})
    print("\n# paste into mok/kernels/moe/configs.py (decode: see the best_decode lines; apply by hand if one"
          " variant wins on every shape):\nCONFIGS = " + pprint.pformat(configs, width=120, sort_dicts=False))
    out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
