"""Sweep of mok.attention's launch configs on the trainer's long-sequence shapes, next to SDPA on the same inputs,
same run. Head layouts (`--heads`): qwen3 (Qwen3-30B-A3B: 32 query, 4 key/value heads, D = 128) and mla (MLA's
absorbed form, DeepSeek-V3: 128 query heads on one latent key head of D = 576 = 512 + 64, values its first 512
features; its wide-head configs, `*_wide`; no SDPA row: SDPA has no kernel for these widths). Sequences: one of
32768 tokens and 8 x 4096.

    PYTHONPATH=. python bench/attention_sweep.py --out sweep.jsonl [--heads qwen3|mla] [--lengths 32768,8x4096]
        [--kernels forward,forward_key_block,backward_dkdv,backward_dq]
    PYTHONPATH=. python bench/attention_sweep.py --out sweep.jsonl --decode 1x544,64x544,256x544   # qwen3 heads
Forward candidates must give the current config's bits (a row's bits depend on KEY_BLOCK only, not on BLOCK_M or
PACK: docs/kernels.md); one that differs is reported and never chosen. The forward_key_block candidates change
KEY_BLOCK, the semantic key block (mok/reference/attention.py key_block_size), so their bits differ by
design: they are timed (and checked against SDPA's output) to decide whether changing it everywhere pays.
Backward candidates (the dK/dV kernel's and the dQ kernel's configs, one varied at a time) must be deterministic
(two runs, equal bits) and agree with the current config's gradients to bf16 rounding. One JSON line per (shape,
candidate): ms, TFLOP/s (causal FLOPs: forward q.k and p.v, backward 3 dots of the key width and 2 of the value
width), ratio to SDPA; the last lines name the fastest valid candidate per kernel, summed over the shapes.

`--decode BATCHxCONTEXT,...`: a vLLM decode step's attention instead (one query per sequence over CONTEXT cached
keys in 16-slot pages, Qwen3-30B-A3B's heads), in CUDA graphs, rotating through cache copies larger than the L2
as a model's layers do: mok.paged_attention's decode configs (DECODE_CANDIDATES, every one must give the
default's bits: BLOCK_M and PACK only regroup rows) against vLLM's FlashAttention 3 (`flash_attn_varlen_func`,
where the vLLM bundle is on PYTHONPATH) with its split-KV heuristic and without splits (`num_splits=1`, the one
schedule mok's bits allow), and the time of reading the cache at copy speed.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json

import torch
import torch.nn.functional as F
import triton

from bench.dense import measure_ms
from bench.timing import cuda_ms
from mok.kernels import attention as kernels


@dataclasses.dataclass(frozen=True)
class Heads:
    q_heads: int
    kv_heads: int
    head_dim: int      # query / key features
    value_dim: int     # value features: MLA's values are the keys' first value_dim features (a view)
    wide: bool         # the kernels' *_wide configs (head_dim > attention.WIDE_HEAD)


HEADS = {"qwen3": Heads(32, 4, 128, 128, wide=False), "mla": Heads(128, 1, 576, 512, wide=True)}


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
        (32, 64, 4, 3, 0), (32, 64, 4, 4), (32, 64, 4, 5), (16, 64, 4, 3), (16, 64, 4, 4),
        (32, 32, 4, 3), (64, 64, 4, 3), (64, 64, 8, 3), (32, 128, 8, 3), (64, 128, 8, 3), (16, 128, 8, 3),
        (32, 64, 8, 3)]],
    "backward_dq": [dict(kernels.CONFIGS["backward_dq"])] + [_config(*c) for c in [
        (128, 64, 8, 3, 0), (128, 64, 8, 2), (128, 64, 8, 4), (128, 32, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
        (64, 64, 4, 4), (128, 64, 4, 3), (64, 128, 4, 3)]],
}


# MLA (absorbed): forward and dQ tiles of BLOCK_M rows holding PACK query heads of one token each (every head reads
# the one latent key head: packing reads a key tile once for PACK heads), dK/dV tiles as the plain configs'
MLA_CANDIDATES = {
    "forward": [dict(kernels.CONFIGS["forward_wide"])] + [
        dict(BLOCK_M=m, PACK=p, num_warps=w, num_stages=s)
        for m, p, w, s in [(32, 1, 8, 1), (32, 1, 8, 2), (16, 1, 4, 1), (64, 1, 8, 1), (32, 4, 8, 1), (32, 16, 8, 1),
                           (64, 16, 8, 1), (64, 64, 8, 1), (128, 64, 16, 1), (64, 16, 4, 1), (64, 8, 8, 1),
                           (64, 16, 8, 2), (64, 8, 8, 3)]],
    "backward_dkdv": [dict(kernels.CONFIGS["backward_dkdv_wide"])] + [_config(*c, tma=0) for c in [
        (16, 16, 8, 1), (64, 16, 8, 1), (32, 32, 8, 1), (32, 16, 4, 1), (32, 16, 8, 2), (64, 32, 8, 1)]],
    "backward_dq": [dict(kernels.CONFIGS["backward_dq_wide"])] + [_config(*c, tma=0) for c in [
        (32, 32, 8, 1), (16, 16, 8, 1), (16, 64, 8, 1), (32, 16, 8, 1), (16, 32, 4, 1), (16, 32, 8, 2)]] + [
        # tiles of PACK heads of a token: one latent key tile read for PACK heads
        dict(_config(m, n, w, s, tma=0), PACK=p)
        for m, n, w, s, p in [(32, 32, 8, 1, 16), (64, 32, 8, 1, 16), (64, 16, 8, 1, 64), (32, 32, 8, 1, 4),
                              (64, 32, 8, 2, 16), (128, 16, 8, 1, 32)]],
}


# Decode tiles (mok.paged_attention(decode=True)) timed beside today's: BLOCK_M rows hold BLOCK_M // PACK query
# positions of PACK heads of a key/value group (PACK must divide the group: others are skipped).
DECODE_CANDIDATES = [
    dict(BLOCK_M=m, PACK=p, num_warps=w, num_stages=s)
    for m, p, w, s in [(16, 8, 4, 1), (16, 8, 4, 3), (16, 8, 4, 4), (16, 8, 2, 2), (16, 8, 8, 2), (16, 4, 4, 2),
                       (16, 2, 4, 2), (16, 1, 4, 2), (32, 8, 4, 2), (64, 8, 4, 2)]]
DECODE_PAGE = 16  # vLLM's default KV block size
DECODE_ROTATED_BYTES = 256 << 20  # cache copies per timed graph: more than the L2 holds

# a candidate that does not compile is reported and never chosen: shared memory of a large key block, a
# warp-specialised loop Triton cannot compile, a tile ptxas cannot fit in the registers (MLA's 128 x 512 fp32
# accumulator on 16 warps)
UNCOMPILABLE = (triton.runtime.errors.OutOfResources, triton.runtime.errors.PTXASError,
                triton.compiler.errors.CompilationError)


def candidates(heads: Heads) -> dict[str, list[dict]]:
    """Kernel name (without the _wide suffix) -> configs, today's first."""
    return MLA_CANDIDATES if heads.wide else CANDIDATES


def causal_flops(lengths: list[int], heads: Heads, key_dots: int, value_dots: int) -> float:
    """2 flops per MAC over half the square: dots of the key width (q.k) and of the value width (p.v)."""
    per_pair = key_dots * heads.head_dim + value_dots * heads.value_dim
    return sum(n * n * heads.q_heads * per_pair for n in lengths)


def inputs(lengths: list[int], heads: Heads):
    gen = torch.Generator(device="cuda").manual_seed(0)
    total = sum(lengths)
    q = torch.randn(total, heads.q_heads, heads.head_dim, device="cuda", generator=gen).bfloat16()
    k = torch.randn(total, heads.kv_heads, heads.head_dim, device="cuda", generator=gen).bfloat16()
    if heads.wide:  # MLA: the values are a view of the latent keys
        v = k[..., :heads.value_dim]
    else:
        v = torch.randn(total, heads.kv_heads, heads.value_dim, device="cuda", generator=gen).bfloat16()
    grad = torch.randn(total, heads.q_heads, heads.value_dim, device="cuda", generator=gen).bfloat16()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return q, k, v, grad, cu


def sdpa_ms(lengths: list[int], heads: Heads, q, k, v, grad) -> tuple[float, float]:
    """SDPA (is_causal) per sequence on k / v repeated to the query heads, the trainer baseline's layout."""
    group = heads.q_heads // heads.kv_heads
    num, length = len(lengths), lengths[0]
    assert all(n == length for n in lengths)
    qb, kb, vb = (t.view(num, length, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
    kb, vb = kb.repeat_interleave(group, 1), vb.repeat_interleave(group, 1)
    gb = grad.view(num, length, heads.q_heads, heads.value_dim).transpose(1, 2)
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


def sdpa_out(heads: Heads, q, k, v) -> torch.Tensor:
    """fp32 [T, Q, D]: SDPA's causal output of one sequence (k / v repeated to the query heads)."""
    k, v = (t.repeat_interleave(heads.q_heads // heads.kv_heads, 1) for t in (k, v))
    out = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), is_causal=True)
    return out[0].transpose(0, 1).float()


def sweep_shape(name: str, lengths: list[int], heads: Heads, out, kernel_names: list[str]) -> dict:
    q, k, v, grad, cu = inputs(lengths, heads)
    scale = heads.head_dim ** -0.5
    sdpa_fwd = sdpa_bwd = None
    if not heads.wide:
        sdpa_fwd, sdpa_fwd_bwd = sdpa_ms(lengths, heads, q, k, v, grad)
        sdpa_bwd = sdpa_fwd_bwd - sdpa_fwd
        out.write(json.dumps(dict(shape=name, impl="sdpa", fwd_ms=sdpa_fwd, bwd_ms=sdpa_bwd)) + "\n")
    fwd_flops, bwd_flops = causal_flops(lengths, heads, 1, 1), causal_flops(lengths, heads, 3, 2)
    times = {}
    table = candidates(heads)

    def record(kernel: str, config: dict, ms: float, flops: float, baseline: float | None, **extra):
        times[(kernel, json.dumps(config, sort_keys=True))] = ms if extra.get("valid", True) else float("inf")
        ratio = None if baseline is None else round(baseline / ms, 3)
        _emit(out, dict(shape=name, kernel=kernel, config=config, ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1),
                        ratio_vs_sdpa=ratio, **extra))

    want_out, want_lse = kernels.attention_forward(q, k, v, cu, cu, scale, True)
    reference = sdpa_out(heads, q, k, v) if len(lengths) == 1 and not heads.wide else None
    for kernel in ("forward", "forward_key_block"):
        for candidate in table.get(kernel, []) if kernel in kernel_names else ():
            config = {key: value for key, value in candidate.items() if key != "KEY_BLOCK"}
            with key_block(candidate.get("KEY_BLOCK")):
                try:
                    got_out, got_lse = kernels.attention_forward(q, k, v, cu, cu, scale, True, config=config)
                except UNCOMPILABLE as err:
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
    suffix = "_wide" if heads.wide else ""
    for kernel in ("backward_dkdv", "backward_dq"):
        for config in table[kernel] if kernel in kernel_names else ():
            try:
                got = backward({kernel + suffix: config})
            except UNCOMPILABLE as err:
                times[(kernel, json.dumps(config, sort_keys=True))] = float("inf")
                out.write(json.dumps(dict(shape=name, kernel=kernel, config=config, error=str(err)[:200])) + "\n")
                continue
            again = backward({kernel + suffix: config})
            deterministic = all(torch.equal(a, b) for a, b in zip(got, again, strict=True))
            rel = max((g.float() - w.float()).abs().max().item() / s for g, w, s in zip(got, want, scale_of))
            ms = cuda_ms(lambda: backward({kernel + suffix: config}), warmup=1, iters=3)
            record(kernel, config, ms, bwd_flops, sdpa_bwd, deterministic=deterministic,
                   max_rel_diff=rel, valid=deterministic and rel < 2e-2)
    return times


def sweep_decode(batch: int, context: int, heads: Heads, out) -> None:
    """One JSON line per decode candidate and baseline at `batch` sequences of `context` cached keys."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    pages = -(-context // DECODE_PAGE)
    cache_bytes = 2 * batch * pages * DECODE_PAGE * heads.kv_heads * heads.head_dim * 2
    copies = max(1, -(-DECODE_ROTATED_BYTES // cache_bytes))
    shape = (batch * pages, DECODE_PAGE, heads.kv_heads, heads.head_dim)
    caches = [(torch.randn(shape, device="cuda", generator=gen).bfloat16(),
               torch.randn(shape, device="cuda", generator=gen).bfloat16()) for _ in range(copies)]
    block_table = torch.randperm(batch * pages, device="cuda", generator=gen).to(torch.int32).view(batch, pages)
    q_BQD = torch.randn(batch, heads.q_heads, heads.head_dim, device="cuda", generator=gen).bfloat16()
    cu_seqlens_q = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    seq_lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    scale = heads.head_dim ** -0.5
    base = dict(kind="decode", batch=batch, context=context, page=DECODE_PAGE, copies=copies)

    def mok_calls(config=None):
        return [kernels.paged_attention_forward(q_BQD, k, v, cu_seqlens_q, seq_lens, block_table, scale, decode=True,
                                                config=None if config is None else dict(config))[0]
                for k, v in caches]

    want = mok_calls()[0]
    group = heads.q_heads // heads.kv_heads
    today = kernels._forward_config(heads.head_dim, group, True)
    timed, today_ms = [], None
    for config in [today] + [c for c in DECODE_CANDIDATES if group % c["PACK"] == 0 and c != today]:
        row = dict(base, impl="mok", config=config)
        try:
            row["equal_bits"] = torch.equal(mok_calls(config)[0], want)
            row["ms"] = round(measure_ms(lambda config=config: mok_calls(config), torch.device("cuda"), graph=True)
                              / copies, 5)
            today_ms = row["ms"] if config is today else today_ms
            if row["equal_bits"]:
                timed.append((row["ms"], config))
        except UNCOMPILABLE as err:
            row["error"] = str(err)[:200]
        _emit(out, row)
    if timed:
        ms, config = min(timed, key=lambda item: item[0])
        _emit(out, dict(best="decode", batch=batch, context=context, config=config, ms=ms, today_ms=today_ms))
    for splits in (0, 1):
        row = dict(base, impl="vllm flash_attn_varlen_func (FA3)", num_splits=splits)
        try:
            from vllm.vllm_flash_attn import flash_attn_varlen_func

            def fa3_calls(splits=splits):
                return [flash_attn_varlen_func(q_BQD, k, v, 1, cu_seqlens_q, context, seqused_k=seq_lens,
                                               softmax_scale=scale, causal=True, block_table=block_table,
                                               fa_version=3, num_splits=splits) for k, v in caches]

            row["max_abs_diff_vs_mok"] = (fa3_calls()[0].float() - want.float()).abs().max().item()
            row["ms"] = round(measure_ms(fa3_calls, torch.device("cuda"), graph=True) / copies, 5)
        except Exception as err:  # no bundle, or an FA3 that refuses: reported, the sweep goes on
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
        _emit(out, row)
    src = torch.empty(cache_bytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = cuda_ms(lambda: dst.copy_(src), warmup=2, iters=10)
    _emit(out, dict(base, impl="cache read at copy speed", ms=round(copy_ms / 2, 5), cache_bytes=cache_bytes))


def _emit(out, row: dict) -> None:
    out.write(json.dumps(row) + "\n")
    out.flush()
    print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="attention-sweep.jsonl")
    parser.add_argument("--lengths", default="32768,8x4096", help="comma-separated shapes: L or BxL")
    parser.add_argument("--kernels", default=",".join(CANDIDATES), help="comma-separated CANDIDATES keys")
    parser.add_argument("--heads", default="qwen3", choices=sorted(HEADS), help="the head layout (HEADS)")
    parser.add_argument("--decode", default="", help="BATCHxCONTEXT,...: decode steps instead (qwen3 heads)")
    args = parser.parse_args()
    kernel_names = args.kernels.split(",")
    heads = HEADS[args.heads]
    if args.decode:
        if heads.wide:
            raise SystemExit("--decode: the qwen3 heads (bench/mla.py times MLA's decode)")
        with open(args.out, "w") as out:
            for shape in args.decode.split(","):
                batch, context = (int(v) for v in shape.split("x"))
                sweep_decode(batch, context, heads, out)
        return
    table = candidates(heads)
    totals: dict = {}
    with open(args.out, "w") as out:
        for shape in args.lengths.split(","):
            count, _, length = shape.rpartition("x")
            lengths = [int(length)] * int(count or 1)
            for key, ms in sweep_shape(shape, lengths, heads, out, kernel_names).items():
                totals[key] = totals.get(key, 0.0) + ms
            torch.cuda.empty_cache()
        for kernel, configs in table.items():
            if kernel not in kernel_names:
                continue
            ranked = sorted((ms, config) for (name, config), ms in totals.items() if name == kernel)
            current = totals[(kernel, json.dumps(configs[0], sort_keys=True))]
            _emit(out, dict(best=kernel, config=json.loads(ranked[0][1]), total_ms=round(ranked[0][0], 3),
                            current_total_ms=round(current, 3)))


if __name__ == "__main__":
    main()
