"""Sweep of mok.attention's launch configs on the trainer's long-sequence shapes (Qwen3-30B-A3B heads: 32 query,
4 key/value, D = 128; one 32768-token sequence and 8 x 4096), next to SDPA on the same inputs, same run.

    PYTHONPATH=. python bench/attention_sweep.py --out sweep.jsonl [--lengths 32768,8x4096]
        [--kernels forward,forward_key_block,backward_dkdv,backward_dq]
Forward candidates must give the current config's bits (a row's bits depend on KEY_BLOCK only:
docs/kernels.md); one that differs is reported and never chosen. The forward_key_block candidates change
KEY_BLOCK, the semantic key block (mok/reference/attention.py key_block_size), so their bits differ by
design: they are timed (and checked against SDPA's output) to decide whether changing it everywhere pays.
Backward candidates (the dK/dV kernel's and the dQ kernel's configs, one varied at a time) must be deterministic
(two runs, equal bits) and agree with the current config's gradients to bf16 rounding. One JSON line per (shape,
candidate): ms, TFLOP/s (causal FLOPs: forward 2 matmuls, backward 5), ratio to SDPA; the last lines name the
fastest valid candidate per kernel, summed over the shapes.
"""
from __future__ import annotations

import argparse
import contextlib
import json

import torch
import torch.nn.functional as F
import triton

from bench.timing import cuda_ms
from mok.kernels import attention as kernels

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 4, 128


def _config(block_m, block_n, warps, stages, tma=1):
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, TMA=tma)


# the first candidate of each kernel is today's config
CANDIDATES = {
    "forward": [dict(kernels.CONFIGS["forward"])] + [
        dict(BLOCK_M=m, PACK=1, num_warps=w, num_stages=s)
        for m, w, s in [(128, 8, 2), (128, 8, 4), (128, 4, 3), (64, 4, 3), (64, 4, 4), (256, 16, 2)]] + [
        # Triton's warp specialisation of the unmasked key loop (the same dots in the same order: the same bits)
        dict(BLOCK_M=m, PACK=1, num_warps=w, num_stages=s, WARP_SPECIALIZE=True)
        for m, w, s in [(128, 8, 3), (128, 4, 3), (128, 8, 2), (64, 4, 3)]],
    # KEY_BLOCK is not a launch option but the semantics (mok/reference/attention.py key_block_size): the sweep
    # swaps key_block_size for the candidate's
    "forward_key_block": [dict(kernels.CONFIGS["forward"])] + [
        dict(BLOCK_M=m, PACK=1, KEY_BLOCK=n, num_warps=w, num_stages=s)
        for m, n, w, s in [(128, 128, 8, 2), (128, 128, 8, 3), (64, 128, 4, 2), (128, 128, 4, 2), (128, 32, 8, 3),
                           (128, 32, 4, 3)]],
    "backward_dkdv": [dict(kernels.CONFIGS["backward_dkdv"])] + [_config(*c) for c in [
        (32, 64, 4, 3, 0), (32, 64, 4, 2), (32, 64, 4, 4), (32, 64, 4, 5), (16, 64, 4, 3), (16, 64, 4, 4),
        (32, 32, 4, 3), (64, 64, 4, 3), (64, 64, 8, 3), (32, 128, 8, 3), (64, 128, 8, 3), (16, 128, 8, 3),
        (32, 64, 8, 3)]],
    "backward_dq": [dict(kernels.CONFIGS["backward_dq"])] + [_config(*c) for c in [
        (128, 64, 8, 3, 0), (128, 64, 8, 2), (128, 64, 8, 4), (128, 32, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
        (64, 64, 4, 4), (128, 64, 4, 3), (64, 128, 4, 3)]],
}


def causal_flops(lengths: list[int], matmuls: int) -> float:
    return sum(matmuls * n * n * Q_HEADS * HEAD_DIM for n in lengths)  # 2 flops per MAC, half the square


def inputs(lengths: list[int]):
    gen = torch.Generator(device="cuda").manual_seed(0)
    total = sum(lengths)
    q = torch.randn(total, Q_HEADS, HEAD_DIM, device="cuda", generator=gen).bfloat16()
    k = torch.randn(total, KV_HEADS, HEAD_DIM, device="cuda", generator=gen).bfloat16()
    v = torch.randn(total, KV_HEADS, HEAD_DIM, device="cuda", generator=gen).bfloat16()
    grad = torch.randn(total, Q_HEADS, HEAD_DIM, device="cuda", generator=gen).bfloat16()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return q, k, v, grad, cu


def sdpa_ms(lengths: list[int], q, k, v, grad) -> tuple[float, float]:
    """SDPA (is_causal) per sequence on k / v repeated to the query heads, the trainer baseline's layout."""
    group = Q_HEADS // KV_HEADS
    num, length = len(lengths), lengths[0]
    assert all(n == length for n in lengths)
    qb, kb, vb = (t.view(num, length, -1, HEAD_DIM).transpose(1, 2) for t in (q, k, v))
    kb, vb = kb.repeat_interleave(group, 1), vb.repeat_interleave(group, 1)
    gb = grad.view(num, length, Q_HEADS, HEAD_DIM).transpose(1, 2)
    fwd = cuda_ms(lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True), warmup=2, iters=5)
    leaves = [t.detach().requires_grad_() for t in (qb, kb, vb)]
    fwd_bwd = cuda_ms(lambda: F.scaled_dot_product_attention(*leaves, is_causal=True).backward(gb), warmup=2, iters=5)
    return fwd, fwd_bwd


@contextlib.contextmanager
def key_block(length: int | None):
    """The attention kernels' semantic key block set to `length` inside (None: unchanged)."""
    if length is None:
        yield
        return
    saved = kernels.key_block_size
    kernels.key_block_size = lambda head_dim: length
    try:
        yield
    finally:
        kernels.key_block_size = saved


def sdpa_out(q, k, v) -> torch.Tensor:
    """fp32 [T, Q, D]: SDPA's causal output of one sequence (k / v repeated to the query heads)."""
    k, v = (t.repeat_interleave(Q_HEADS // KV_HEADS, 1) for t in (k, v))
    out = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), is_causal=True)
    return out[0].transpose(0, 1).float()


def sweep_shape(name: str, lengths: list[int], out, kernel_names: list[str]) -> dict:
    q, k, v, grad, cu = inputs(lengths)
    scale = HEAD_DIM ** -0.5
    sdpa_fwd, sdpa_fwd_bwd = sdpa_ms(lengths, q, k, v, grad)
    out.write(json.dumps(dict(shape=name, impl="sdpa", fwd_ms=sdpa_fwd, bwd_ms=sdpa_fwd_bwd - sdpa_fwd)) + "\n")
    fwd_flops, bwd_flops = causal_flops(lengths, 2), causal_flops(lengths, 5)
    times = {}

    def record(kernel: str, config: dict, ms: float, flops: float, baseline: float, **extra):
        times[(kernel, json.dumps(config, sort_keys=True))] = ms if extra.get("valid", True) else float("inf")
        row = dict(shape=name, kernel=kernel, config=config, ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1),
                   ratio_vs_sdpa=round(baseline / ms, 3), **extra)
        out.write(json.dumps(row) + "\n")
        out.flush()
        print(json.dumps(row), flush=True)

    want_out, want_lse = kernels.attention_forward(q, k, v, cu, cu, scale, True)
    reference = sdpa_out(q, k, v) if len(lengths) == 1 else None
    for kernel in ("forward", "forward_key_block"):
        for candidate in CANDIDATES[kernel] if kernel in kernel_names else ():
            config = {key: value for key, value in candidate.items() if key != "KEY_BLOCK"}
            with key_block(candidate.get("KEY_BLOCK")):
                try:
                    got_out, got_lse = kernels.attention_forward(q, k, v, cu, cu, scale, True, config=config)
                # e.g. shared memory of a large key block; a warp-specialised loop Triton cannot compile
                except (triton.runtime.errors.OutOfResources, triton.compiler.errors.CompilationError) as err:
                    times[(kernel, json.dumps(candidate, sort_keys=True))] = float("inf")
                    out.write(json.dumps(dict(shape=name, kernel=kernel, config=candidate, error=str(err)[:200]))
                              + "\n")
                    continue
                ms = cuda_ms(lambda: kernels.attention_forward(q, k, v, cu, cu, scale, True, config=config),
                             warmup=1, iters=3)
            equal = torch.equal(got_out, want_out) and torch.equal(got_lse, want_lse)
            # a key block of another length is other semantics: timed, checked against SDPA, never chosen
            error = None if reference is None else (got_out.float() - reference).abs().max().item()
            record(kernel, candidate, ms, fwd_flops, sdpa_fwd, equal_bits=equal, max_abs_diff_vs_sdpa=error,
                   valid=equal or kernel == "forward_key_block")

    def backward(configs):
        return kernels.attention_backward(grad, q, k, v, want_out, want_lse, cu, cu, scale, True, configs=configs)

    want = backward(None)
    scale_of = [w.float().abs().max().item() for w in want]
    for kernel in ("backward_dkdv", "backward_dq"):
        for config in CANDIDATES[kernel] if kernel in kernel_names else ():
            got = backward({kernel: config})
            again = backward({kernel: config})
            deterministic = all(torch.equal(a, b) for a, b in zip(got, again, strict=True))
            rel = max((g.float() - w.float()).abs().max().item() / s for g, w, s in zip(got, want, scale_of))
            ms = cuda_ms(lambda: backward({kernel: config}), warmup=1, iters=3)
            record(kernel, config, ms, bwd_flops, sdpa_fwd_bwd - sdpa_fwd, deterministic=deterministic,
                   max_rel_diff=rel, valid=deterministic and rel < 2e-2)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="attention-sweep.jsonl")
    parser.add_argument("--lengths", default="32768,8x4096", help="comma-separated shapes: L or BxL")
    parser.add_argument("--kernels", default=",".join(CANDIDATES), help="comma-separated CANDIDATES keys")
    args = parser.parse_args()
    kernel_names = args.kernels.split(",")
    totals: dict = {}
    with open(args.out, "w") as out:
        for shape in args.lengths.split(","):
            count, _, length = shape.rpartition("x")
            lengths = [int(length)] * int(count or 1)
            for key, ms in sweep_shape(shape, lengths, out, kernel_names).items():
                totals[key] = totals.get(key, 0.0) + ms
            torch.cuda.empty_cache()
        for kernel, candidates in CANDIDATES.items():
            if kernel not in kernel_names:
                continue
            ranked = sorted((ms, config) for (name, config), ms in totals.items() if name == kernel)
            current = totals[(kernel, json.dumps(candidates[0], sort_keys=True))]
            best = dict(best=kernel, config=json.loads(ranked[0][1]), total_ms=round(ranked[0][0], 3),
                        current_total_ms=round(current, 3))
            out.write(json.dumps(best) + "\n")
            print(json.dumps(best), flush=True)


if __name__ == "__main__":
    main()
