"""Dense-op benchmark: mok's batch-invariant ops against their torch counterparts, same run, forward and
forward+backward.

    PYTHONPATH=. python bench/dense.py [--out rows.jsonl] [--json bench/results/dense-latest.json]
        [--tokens 1 64 4096 16384 65536] [--ops rotary,rms_norm] [--passes fwd,fwd+bwd] [--logits-rows 16384]
        [--triton-launch]   # mok's kernels through Triton's own launch (meta "launch": "triton"), the ablation
        [--graph]           # each call replayed from a CUDA graph (meta "timing": "cuda_graph"): GPU time alone
    PYTHONPATH=. python bench/dense.py --device cpu --shape tiny --tokens 1 5   # dry run of every code path

Shapes (docs/shapes.md): --shape qwen3-30b-a3b (default): hidden 2048, 32 query / 4 key-value heads of 128,
rope theta 1e6, vocab 151936, MLP intermediate 6144; --shape tiny: a few features of each, for dry runs.
Cases, at T tokens (mok call | torch counterpart):
  linear_qkv         mok.linear(x, w_qkv)                  | x @ w_qkv.T (cuBLAS), w_qkv [5120, 2048]
  lm_head            mok.linear(x, w_head)                 | x @ w_head.T, w_head [151936, 2048]
  rms_norm           mok.rms_norm(x, w, eps)               | F.rms_norm(x, (2048,), w, eps)
  rms_norm_residual  mok.rms_norm(x, w, eps, residual)     | r = x + residual; (F.rms_norm(r, ...), r)
  qk_norm            mok.rms_norm(q, w_q), mok.rms_norm(k, | F.rms_norm(q, (128,), w_q, eps), the same for k
                     w_k) per head (q [T, 32, 128], k [T, 4, 128]: Qwen3's q/k norms)
  rotary             mok.rotary(q), mok.rotary(k)          | transformers' Qwen3 apply_rotary_pos_emb: cos, sin
                     (q [T, 32, 128], k [T, 4, 128],       |   gathered by position from precomputed bf16
                     positions 0..T-1)                     |   tables [positions, 128], q * cos + rotate_half(q)
                                                           |   * sin, and the same for k, in bf16
  silu_and_mul       mok.silu_and_mul(h)                   | F.silu(h[:, :I]) * h[:, I:], h [T, 2 * 6144]
  log_softmax        mok.log_softmax(logits)               | logits.float().log_softmax(-1)
  logprobs           mok.logprobs(logits, ids)             | log_softmax(...).gather(ids)
  attention_prefill  mok.attention, one causal sequence    | SDPA (is_causal) on k/v repeated to 32 heads
                     of T tokens (GQA 32:4)                |   (HF's repeat_kv, inside the timed call)
  route_grouped      mok.route_grouped(logits, 8, 8 groups, | transformers' DeepseekV3MoE.route_tokens_to_experts
                     4 kept, bias, renormalize, 2.5),      |   (torch ops), the same arguments
                     fp32 logits [T, 256], DeepSeek-V3's   |
                     routing; both sides' weights scattered into [T, 256] (order-free, comparable)
The vocab-sized cases (lm_head, log_softmax, logprobs) use min(T, --logits-rows) rows ("rows" in the output).
Passes: fwd (under no_grad) and fwd+bwd (forward with every float input of the op as a leaf requiring grad,
then backward of a fixed random gradient of each output). Times: bench/timing.py's cuda_ms (CUDA events
around repeated calls after a warm-up), the fastest of ROUNDS rounds, each's repeat count fitting a budget;
on --device cpu a wall-clock mean (a dry run: the numbers mean nothing). With --graph, GRAPH_REPEAT calls (mok's
and torch's alike) are captured back to back in one CUDA graph and the replay's time is divided by them: no host
work per call, so the figure is the GPU time of the kernels and of the gaps between them (what a caller that captures
its step pays: vLLM's CUDA graphs, a training step compiled with mode="reduce-overhead"). Eager calls at small
T are bound by the host (each mok op is a Python function; its torch counterpart is dispatched in C++): the
two timings side by side say how much of a ratio is the host's.

Output: one JSON line per (op, T) on stdout and in --out; --json writes the summary object
  {"meta": {gpu, torch, triton, cuda, date, shape, device, speedup, launch, timing}, "<op>": {"<T>": {"rows",
   "mok_fwd_ms", "torch_fwd_ms", "fwd_speedup_vs_torch", "mok_fwdbwd_ms", "torch_fwdbwd_ms",
   "fwdbwd_speedup_vs_torch"}}}
with speedup_vs_torch = torch_ms / mok_ms: above 1 mok is faster, 0.8 means mok takes 1.25x torch's time
(the issue's "within 0.8x of its torch counterpart" is speedup_vs_torch >= 0.8). A pass that ran out of
memory or failed has "<pass>_error" instead of its numbers.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import mok
from bench.timing import capture_graph, cuda_ms

DEEPSEEK_V3_ROUTING = dict(experts=256, n_group=8, topk_group=4, top_k=8, scaling=2.5)
"""The routing of every DeepSeek-V3 / Kimi-K2-sized checkpoint (route_grouped's case at every --shape but tiny)."""
SHAPES = {
    "qwen3-30b-a3b": dict(hidden=2048, heads=32, kv_heads=4, head_dim=128, vocab=151936, intermediate=6144,
                          theta=1e6, routing=DEEPSEEK_V3_ROUTING),
    "tiny": dict(hidden=64, heads=4, kv_heads=2, head_dim=16, vocab=300, intermediate=32, theta=1e4,
                 routing=dict(experts=16, n_group=4, topk_group=2, top_k=4, scaling=2.5)),
}
OPS = ("linear_qkv", "lm_head", "rms_norm", "rms_norm_residual", "qk_norm", "rotary", "silu_and_mul", "log_softmax",
       "logprobs", "attention_prefill", "route_grouped")
PASSES = ("fwd", "fwd+bwd")
PASS_KEY = {"fwd": "fwd", "fwd+bwd": "fwdbwd"}
EPS = 1e-6
# Per measurement: ROUNDS rounds of about BUDGET_MS / ROUNDS each (between 3 and MAX_ITERS calls), the fastest round
# kept. Why: eager calls of the small ops at T = 4096 take 10-200 us, nearly all host time, and one round of 20 calls
# moved their ratios by up to 2x between two runs of the same tree.
BUDGET_MS = 300.0
ROUNDS = 3
MAX_ITERS = 200
GRAPH_REPEAT = 10  # calls per CUDA graph with --graph


@dataclass
class Case:
    """One op at one T: `mok(**inputs)` against `torch_fn(**inputs)` (each -> a tensor or a tuple of tensors).
    fwd+bwd makes a leaf requiring grad of every input named in `differentiable`."""

    op: str
    rows: int
    inputs: dict[str, torch.Tensor]
    differentiable: tuple[str, ...]
    mok: Callable
    torch_fn: Callable


# ---------------------------------------------------------------------------------------------
# the torch counterparts


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half (models/qwen3/modeling_qwen3.py)."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rope_tables(theta: float, head_dim: int, rows: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [rows, D] in `dtype`: transformers' Qwen3RotaryEmbedding (fp32 inv_freq and angles, cat(freqs,
    freqs), cos/sin, cast to the activations' dtype), for positions 0..rows-1, computed once."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    freqs = torch.arange(rows, device=device).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def torch_rotary(q_TQD, k_TGD, positions_T, cos_table, sin_table):
    """transformers' apply_rotary_pos_emb on [T, heads, D] (cos/sin [T, D] gathered by position, unsqueezed
    over the heads)."""
    cos, sin = cos_table[positions_T].unsqueeze(1), sin_table[positions_T].unsqueeze(1)
    return q_TQD * cos + rotate_half(q_TQD) * sin, k_TGD * cos + rotate_half(k_TGD) * sin


def torch_route_grouped(logits_TE, bias_E, top_k: int, n_group: int, topk_group: int, scaling: float):
    """transformers' DeepseekV3MoE.route_tokens_to_experts (models/deepseek_v3/modeling_deepseek_v3.py, norm_topk_prob
    on): sigmoid scores, the bias for the choice only, groups scored by their two best, (ids [T, K], weights)."""
    num_experts = logits_TE.shape[1]
    scores_TE = logits_TE.sigmoid()
    choice_TE = scores_TE + bias_E
    group_scores = choice_TE.view(-1, n_group, num_experts // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, num_experts // n_group).reshape(-1, num_experts)
    choice_TE = choice_TE.masked_fill(~score_mask.bool(), 0.0)
    ids_TK = torch.topk(choice_TE, k=top_k, dim=-1, sorted=False)[1]
    weights_TK = scores_TE.gather(1, ids_TK)
    weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
    return ids_TK, weights_TK * scaling


def dense_routes(ids_TK: torch.Tensor, weights_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """weights [T, K] at their ids, as [T, E] (zeros elsewhere): two routings compare whatever their order."""
    return weights_TK.new_zeros(weights_TK.shape[0], num_experts).scatter(1, ids_TK.long(), weights_TK)


def torch_attention(q, k, v):
    """One causal sequence q [T, Q, D], k, v [T, G, D]: [1, heads, T, D] views, k/v repeated to the query heads
    (transformers' repeat_kv)."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)[0]


# ---------------------------------------------------------------------------------------------
# cases


class _Builder:
    """The inputs of one T (shape letters: docs/shapes.md); each method builds one op's Case."""

    def __init__(self, shape: dict, tokens: int, device: torch.device, logits_rows: int):
        self.shape, self.tokens, self.device = shape, tokens, device
        self.rows = min(tokens, logits_rows)  # the vocab-sized cases
        self.gen = torch.Generator(device=device).manual_seed(tokens)
        self.hidden = shape["hidden"]

    def randn(self, *size, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*size, device=self.device, generator=self.gen) * scale).to(dtype)

    def per_head(self, heads_key: str) -> torch.Tensor:
        """[T, heads, D] of shape[heads_key] heads."""
        return self.randn(self.tokens, self.shape[heads_key], self.shape["head_dim"])

    def linear_qkv(self) -> Case:
        s, hidden = self.shape, self.hidden
        w_OF = self.randn((s["heads"] + 2 * s["kv_heads"]) * s["head_dim"], hidden, scale=hidden**-0.5)
        return Case("linear_qkv", self.tokens, dict(x=self.randn(self.tokens, hidden), w=w_OF), ("x", "w"),
                    lambda x, w: mok.linear(x, w), lambda x, w: x @ w.t())

    def lm_head(self) -> Case:
        hidden = self.hidden
        inputs = dict(x=self.randn(self.rows, hidden), w=self.randn(self.shape["vocab"], hidden, scale=hidden**-0.5))
        return Case("lm_head", self.rows, inputs, ("x", "w"), lambda x, w: mok.linear(x, w), lambda x, w: x @ w.t())

    def rms_norm(self) -> Case:
        hidden = self.hidden
        inputs = dict(x=self.randn(self.tokens, hidden), w=1 + self.randn(hidden, scale=0.1))
        return Case("rms_norm", self.tokens, inputs, ("x", "w"), lambda x, w: mok.rms_norm(x, w, EPS),
                    lambda x, w: F.rms_norm(x, (hidden,), w, EPS))

    def rms_norm_residual(self) -> Case:
        hidden = self.hidden

        def torch_fused(x, w, residual):
            r = x + residual
            return F.rms_norm(r, (hidden,), w, EPS), r

        inputs = dict(x=self.randn(self.tokens, hidden), w=1 + self.randn(hidden, scale=0.1),
                      residual=self.randn(self.tokens, hidden))
        return Case("rms_norm_residual", self.tokens, inputs, ("x", "w", "residual"),
                    lambda x, w, residual: mok.rms_norm(x, w, EPS, residual), torch_fused)

    def qk_norm(self) -> Case:
        head_dim = self.shape["head_dim"]
        inputs = dict(q=self.per_head("heads"), k=self.per_head("kv_heads"), w_q=1 + self.randn(head_dim, scale=0.1),
                      w_k=1 + self.randn(head_dim, scale=0.1))
        return Case("qk_norm", self.tokens, inputs, ("q", "k", "w_q", "w_k"),
                    lambda q, k, w_q, w_k: (mok.rms_norm(q, w_q, EPS), mok.rms_norm(k, w_k, EPS)),
                    lambda q, k, w_q, w_k: (F.rms_norm(q, (head_dim,), w_q, EPS), F.rms_norm(k, (head_dim,), w_k, EPS)))

    def rotary(self) -> Case:
        s, tokens, theta = self.shape, self.tokens, self.shape["theta"]
        cos_table, sin_table = rope_tables(theta, s["head_dim"], tokens, self.device, torch.bfloat16)
        inputs = dict(q=self.per_head("heads"), k=self.per_head("kv_heads"),
                      positions=torch.arange(tokens, device=self.device))
        return Case("rotary", tokens, inputs, ("q", "k"),
                    lambda q, k, positions: (mok.rotary(q, positions, theta), mok.rotary(k, positions, theta)),
                    lambda q, k, positions: torch_rotary(q, k, positions, cos_table, sin_table))

    def silu_and_mul(self) -> Case:
        inter = self.shape["intermediate"]
        return Case("silu_and_mul", self.tokens, dict(h=self.randn(self.tokens, 2 * inter, scale=3.0)), ("h",),
                    lambda h: mok.silu_and_mul(h), lambda h: F.silu(h[:, :inter]) * h[:, inter:])

    def log_softmax(self) -> Case:
        return Case("log_softmax", self.rows, dict(logits=self.randn(self.rows, self.shape["vocab"], scale=4.0)),
                    ("logits",), lambda logits: mok.log_softmax(logits), lambda logits: logits.float().log_softmax(-1))

    def logprobs(self) -> Case:
        vocab = self.shape["vocab"]
        inputs = dict(logits=self.randn(self.rows, vocab, scale=4.0),
                      ids=torch.randint(0, vocab, (self.rows,), device=self.device, generator=self.gen))
        return Case("logprobs", self.rows, inputs, ("logits",), lambda logits, ids: mok.logprobs(logits, ids),
                    lambda logits, ids: logits.float().log_softmax(-1).gather(1, ids[:, None])[:, 0])

    def attention_prefill(self) -> Case:
        s, tokens = self.shape, self.tokens
        cu = torch.tensor([0, tokens], dtype=torch.int32, device=self.device)
        scale = s["head_dim"] ** -0.5
        inputs = dict(q=self.per_head("heads"), k=self.per_head("kv_heads"), v=self.per_head("kv_heads"))
        return Case("attention_prefill", tokens, inputs, ("q", "k", "v"),
                    lambda q, k, v: mok.attention(q, k, v, cu, cu, scale), torch_attention)


    def route_grouped(self) -> Case:
        r = self.shape["routing"]
        arguments = dict(top_k=r["top_k"], n_group=r["n_group"], topk_group=r["topk_group"], scaling=r["scaling"])
        inputs = dict(logits=self.randn(self.tokens, r["experts"], dtype=torch.float32),
                      bias=self.randn(r["experts"], scale=0.1, dtype=torch.float32))

        def mok_routes(logits, bias):
            return dense_routes(*mok.route_grouped(logits, bias_E=bias, **arguments), r["experts"])

        def torch_routes(logits, bias):
            return dense_routes(*torch_route_grouped(logits, bias, **arguments), r["experts"])

        return Case("route_grouped", self.tokens, inputs, ("logits",), mok_routes, torch_routes)


def cases(shape: dict, tokens: int, device: torch.device, ops=OPS, logits_rows: int = 16384) -> Iterator[Case]:
    """The cases of `ops` at `tokens` tokens, built one at a time: a case's tensors live only as long as the
    Case (the generator keeps none of them)."""
    builder = _Builder(shape, tokens, torch.device(device), logits_rows)
    for op in ops:
        yield getattr(builder, op)()


# ---------------------------------------------------------------------------------------------
# passes and timing


def _outputs(out) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def forward_call(fn: Callable, inputs: dict) -> Callable[[], object]:
    def run():
        with torch.no_grad():
            return fn(**inputs)

    return run


def forward_backward_call(fn: Callable, inputs: dict, differentiable: tuple[str, ...]) -> Callable[[], None]:
    """A call running fn on leaves and back-propagating fixed random output gradients into them."""
    leaves = {k: (v.detach().requires_grad_() if k in differentiable else v) for k, v in inputs.items()}
    gen = torch.Generator(device=next(iter(inputs.values())).device).manual_seed(1)
    with torch.no_grad():
        grads = [torch.randn(o.shape, device=o.device, generator=gen).to(o.dtype) for o in _outputs(fn(**inputs))]

    def run():
        for name in differentiable:
            leaves[name].grad = None
        torch.autograd.backward(_outputs(fn(**leaves)), grads)

    return run


def measure_ms(run: Callable, device: torch.device, graph: bool = False) -> float:
    """ms per call: the fastest of ROUNDS means of cuda_ms (CUDA events) fitting BUDGET_MS; with `graph`, of the replay
    of GRAPH_REPEAT calls captured in one CUDA graph; wall clock on the CPU."""
    if graph:
        captured = capture_graph(run, GRAPH_REPEAT)
        try:
            return cuda_ms(captured.replay, warmup=1, iters=5) / GRAPH_REPEAT
        finally:
            captured.reset()
    if device.type == "cuda":
        once = cuda_ms(run, warmup=1, iters=1)
        iters = max(3, min(MAX_ITERS, int(BUDGET_MS / ROUNDS / max(once, 1e-3))))
        return min(cuda_ms(run, warmup=1, iters=iters) for _ in range(ROUNDS))
    run()
    start = time.perf_counter()
    for _ in range(2):
        run()
    return (time.perf_counter() - start) / 2 * 1e3


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _time_pass(fn: Callable, case: Case, pass_name: str, device: torch.device, graph: bool) -> float:
    """ms of one side's pass; its leaves, gradients and outputs go when this returns (or raises)."""
    run = (forward_call(fn, case.inputs) if pass_name == "fwd"
           else forward_backward_call(fn, case.inputs, case.differentiable))
    return measure_ms(run, device, graph)


def bench_case(case: Case, passes, device: torch.device, graph: bool = False) -> dict:
    """{"rows", "mok_<pass>_ms", "torch_<pass>_ms", "<pass>_speedup_vs_torch"} (or "<pass>_error")."""
    row = {"rows": case.rows}
    for pass_name in passes:
        key = PASS_KEY[pass_name]
        try:
            times = {}
            for side, fn in (("mok", case.mok), ("torch", case.torch_fn)):
                times[side] = _time_pass(fn, case, pass_name, device, graph)
                _free(device)
        except torch.cuda.OutOfMemoryError as err:
            row[f"{key}_error"] = f"out of memory: {str(err).splitlines()[0][:200]}"
        except RuntimeError as err:
            row[f"{key}_error"] = str(err).splitlines()[0][:300]
        else:
            row[f"mok_{key}_ms"] = round(times["mok"], 4)
            row[f"torch_{key}_ms"] = round(times["torch"], 4)
            row[f"{key}_speedup_vs_torch"] = round(times["torch"] / times["mok"], 3)
        _free(device)
    return row


def meta(device: torch.device, shape_name: str) -> dict:
    import triton

    cuda = device.type == "cuda"
    return {"gpu": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "shape": shape_name,
            "device": str(device), "speedup": "speedup_vs_torch = torch_ms / mok_ms (> 1: mok faster)"}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON lines, one per (op, T)")
    parser.add_argument("--json", default=None, help="the summary object (bench/results/dense-latest.json)")
    parser.add_argument("--tokens", type=int, nargs="*", default=[1, 64, 4096, 16384, 65536])
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--passes", default=",".join(PASSES))
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--logits-rows", type=int, default=16384, help="rows of lm_head, log_softmax, logprobs")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--triton-launch", action="store_true",
                        help="launch mok's kernels through Triton's JITFunction.run, not mok's cached launch path "
                             "(the host-cost ablation of mok/kernels/launch.py)")
    parser.add_argument("--graph", action="store_true",
                        help=f"time {GRAPH_REPEAT} calls replayed from one CUDA graph (GPU time without host work)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.graph and device.type != "cuda":
        parser.error("--graph needs a CUDA device")
    if args.triton_launch:
        from mok.kernels import launch

        launch.CACHED_LAUNCH_ENABLED = False
    ops = [op for op in args.ops.split(",") if op]
    passes = [p for p in args.passes.split(",") if p]
    unknown = sorted(set(ops) - set(OPS)) + sorted(set(passes) - set(PASSES))
    if unknown:
        parser.error(f"unknown ops or passes {unknown}; ops: {list(OPS)}, passes: {list(PASSES)}")
    summary = {"meta": {**meta(device, args.shape), "launch": "triton" if args.triton_launch else "cached",
                        "timing": "cuda_graph" if args.graph else "eager"}}
    print(json.dumps(summary["meta"]), flush=True)
    lines = []
    for tokens in args.tokens:
        for case in cases(SHAPES[args.shape], tokens, device, ops, args.logits_rows):
            op, row = case.op, bench_case(case, passes, device, args.graph)
            del case
            _free(device)
            summary.setdefault(op, {})[str(tokens)] = row
            lines.append({"op": op, "tokens": tokens, **row})
            print(json.dumps(lines[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(line) + "\n" for line in [summary["meta"], *lines])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
            f.write("\n")
    return summary

if __name__ == "__main__":
    main()
