"""Benchmark mok.attention against torch SDPA (flash backend) in the same run, on one GPU.

Shapes: docs/shapes.md. Causal GQA attention, bf16, D = 128, Q = 32 query heads over G = 4 key/value
heads (8:1), B sequences of L tokens with B * L = 32768 (L = 4096..32768). SDPA runs on K/V expanded
to Q heads beforehand (the flash backend wants equal head counts; the expansion is not timed).
Decode: one query per sequence over a paged cache (page size 16), batch 64, context 4096, against the
time to read the cache's K and V once at the measured copy bandwidth (the HBM bound).
Writes JSON lines to stdout and a summary to --json (bench/results/attention-latest.json).

    python -m bench.attention --json bench/results/attention-latest.json
"""
from __future__ import annotations

import argparse
import json
import platform

import torch
import torch.nn.functional as F

import mok
from bench.timing import cuda_ms


def _peak_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def bench_prefill(seq_len: int, total_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int) -> dict:
    batch = max(1, total_tokens // seq_len)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q_TQD = torch.randn(batch * seq_len, num_q_heads, head_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    k_SGD = torch.randn(batch * seq_len, num_kv_heads, head_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    v_SGD = torch.randn_like(k_SGD)
    grad_TQD = torch.randn_like(q_TQD)
    cu_seqlens = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * seq_len
    scale = head_dim**-0.5
    q_leaf, k_leaf, v_leaf = (t.clone().requires_grad_() for t in (q_TQD, k_SGD, v_SGD))

    def mok_fwd():
        return mok.attention(q_TQD, k_SGD, v_SGD, cu_seqlens, cu_seqlens, scale)

    def mok_fwd_bwd():
        out = mok.attention(q_leaf, k_leaf, v_leaf, cu_seqlens, cu_seqlens, scale)
        out.backward(grad_TQD)

    group = num_q_heads // num_kv_heads
    q_BQLD = q_TQD.view(batch, seq_len, num_q_heads, head_dim).transpose(1, 2)
    k_BQLD = k_SGD.view(batch, seq_len, num_kv_heads, head_dim).repeat_interleave(group, 2).transpose(1, 2)
    v_BQLD = v_SGD.view(batch, seq_len, num_kv_heads, head_dim).repeat_interleave(group, 2).transpose(1, 2)
    grad_BQLD = grad_TQD.view(batch, seq_len, num_q_heads, head_dim).transpose(1, 2)
    sq, sk, sv = (t.detach().clone().requires_grad_() for t in (q_BQLD, k_BQLD, v_BQLD))

    def sdpa_fwd():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q_BQLD, k_BQLD, v_BQLD, is_causal=True, scale=scale)

    def sdpa_fwd_bwd():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(sq, sk, sv, is_causal=True, scale=scale).backward(grad_BQLD)

    with torch.no_grad():
        mok_out = mok_fwd()
        sdpa_out = sdpa_fwd().transpose(1, 2).reshape_as(mok_out)
    max_err = (mok_out.float() - sdpa_out.float()).abs().max().item()
    flops_fwd = 4 * batch * seq_len * seq_len * num_q_heads * head_dim / 2  # causal: half the square
    row = dict(kind="prefill", seq_len=seq_len, batch=batch, q_heads=num_q_heads, kv_heads=num_kv_heads,
               head_dim=head_dim, max_abs_diff_vs_sdpa=max_err)
    with torch.no_grad():
        row["mok_fwd_ms"] = cuda_ms(mok_fwd)
        row["sdpa_fwd_ms"] = cuda_ms(sdpa_fwd)
        row["mok_fwd_peak_mib"] = _peak_mib(mok_fwd)
        row["sdpa_fwd_peak_mib"] = _peak_mib(sdpa_fwd)
    row["mok_fwd_bwd_ms"] = cuda_ms(mok_fwd_bwd, iters=5)
    row["sdpa_fwd_bwd_ms"] = cuda_ms(sdpa_fwd_bwd, iters=5)
    row["mok_fwd_bwd_peak_mib"] = _peak_mib(mok_fwd_bwd)
    row["sdpa_fwd_bwd_peak_mib"] = _peak_mib(sdpa_fwd_bwd)
    row["fwd_ratio"] = row["sdpa_fwd_ms"] / row["mok_fwd_ms"]
    row["fwd_bwd_ratio"] = row["sdpa_fwd_bwd_ms"] / row["mok_fwd_bwd_ms"]
    row["mok_fwd_tflops"] = flops_fwd / row["mok_fwd_ms"] / 1e9
    row["mok_fwd_bwd_tflops"] = 3.5 * flops_fwd / row["mok_fwd_bwd_ms"] / 1e9
    return row


def bench_decode(batch: int, context: int, page_size: int, num_q_heads: int, num_kv_heads: int,
                 head_dim: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(1)
    pages_per_seq = context // page_size
    num_pages = batch * pages_per_seq
    key_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, device="cuda", generator=gen,
                            dtype=torch.bfloat16)
    value_cache = torch.randn_like(key_cache)
    block_table = torch.randperm(num_pages, device="cuda", generator=gen).to(torch.int32).view(batch, pages_per_seq)
    q_TQD = torch.randn(batch, num_q_heads, head_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    cu_seqlens_q = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    seq_lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    scale = head_dim**-0.5

    def decode():
        return mok.paged_attention(q_TQD, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, scale,
                                   decode=True)

    copy_src = torch.empty(2 * key_cache.numel(), dtype=torch.bfloat16, device="cuda")
    copy_dst = torch.empty_like(copy_src)
    copy_ms = cuda_ms(lambda: copy_dst.copy_(copy_src))
    read_bytes = 2 * key_cache.numel() * key_cache.element_size()
    copy_tb_s = 2 * read_bytes / copy_ms / 1e9  # a copy reads and writes
    decode_ms = cuda_ms(decode, iters=50)
    graph = torch.cuda.CUDAGraph()
    decode()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        decode()
    graph_ms = cuda_ms(graph.replay, iters=50)
    bound_ms = read_bytes / (copy_tb_s * 1e9)
    return dict(kind="decode", batch=batch, context=context, page_size=page_size, q_heads=num_q_heads,
                kv_heads=num_kv_heads, head_dim=head_dim, mok_decode_ms=decode_ms, mok_decode_graph_ms=graph_ms,
                kv_bytes=read_bytes, copy_tb_s=copy_tb_s, hbm_bound_ms=bound_ms,
                ratio_to_bound=graph_ms / bound_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", default="4096,8192,16384,32768")
    parser.add_argument("--total-tokens", type=int, default=32768)
    parser.add_argument("--json", default=None, help="write the summary here")
    args = parser.parse_args()
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, python=platform.python_version())
    import triton

    meta["triton"] = triton.__version__
    print(json.dumps(dict(kind="meta", **meta)), flush=True)
    rows = []
    for seq_len in [int(s) for s in args.seq_lens.split(",")]:
        rows.append(bench_prefill(seq_len, args.total_tokens, 32, 4, 128))
        print(json.dumps(rows[-1]), flush=True)
    rows.append(bench_decode(64, 4096, 16, 32, 4, 128))
    print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, prefill=[r for r in rows if r["kind"] == "prefill"],
                           decode=[r for r in rows if r["kind"] == "decode"]), f, indent=1)


if __name__ == "__main__":
    main()
