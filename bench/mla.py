"""Benchmark Multi-head Latent Attention (DeepSeek-V3 family) on mok against transformers' own, in the same run.

Shapes: docs/shapes.md (A latent, R rope, M no-rope, W value dims). The block is one layer's attention, hidden
states in and o_proj's output out, with the same weights on both sides: mok's absorbed form
(rl/models/mla.py: the query absorbed through W_UK, mok.attention over the latent keys [kv_c, k_pe] with values
kv_c, the output through W_UV; docs/contracts.md) against transformers' DeepseekV3Attention with SDPA (keys and
values expanded per head through kv_b_proj), causal, bf16, B sequences of L tokens with B * L = --total-tokens.
Forward and forward + backward (gradients of the hidden states and of every weight on both sides).
Decode: mok.paged_attention over a latent cache [P, 64, 1, A + R] (vLLM's MLA layout, values its first A features),
one query of Q heads per sequence, against the time to read the cache's used pages once at the measured copy
bandwidth (the KV-read bound the issue sets at 1.5x).

    python -m bench.mla --json bench/results/mla-latest.json          # GPU: deepseek-v3 and moonlight shapes
    python -m bench.mla --device cpu --shapes tiny --seq-lens 64      # a dry run anywhere
"""
from __future__ import annotations

import argparse
import json
import platform

import torch

from bench.dense import measure_ms

SHAPES = {
    # DeepSeek-V3 / R1 / Kimi-K2's attention (q LoRA), with DeepSeek-V3's YaRN
    "deepseek-v3": dict(hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
                        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
                                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}),
    # Moonlight-16B-A3B / DeepSeek-V2-Lite (a plain q_proj)
    "moonlight": dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None,
                      kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                      rope_parameters={"rope_type": "default", "rope_theta": 50000.0}),
    "tiny": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32,
                 qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}
# Decode tile configs timed beside the default (attention.CONFIGS["decode_wide"]); PACK is the query heads of a tile
# (a power of two dividing the heads, at most BLOCK_M). Any of them must give the default's bits.
DECODE_CANDIDATES = [dict(BLOCK_M=m, PACK=m, num_warps=w, num_stages=s)
                     for m, w, s in [(16, 4, 1), (32, 8, 1), (64, 8, 1), (64, 8, 2), (128, 8, 1)]]
# one dense layer: only its attention is timed
_LAYER = dict(num_hidden_layers=1, first_k_dense_replace=1, intermediate_size=128, vocab_size=256,
              max_position_embeddings=65536)


def attention_layer(shape: str, device: torch.device):
    """(mok's MLAttention, transformers' DeepseekV3Attention with SDPA, rotary embedding module), same weights."""
    from rl import wrap
    from rl.models import adapter_for
    from rl.testing import tiny_model

    model = tiny_model("deepseek_v3", seed=0, device=device, **_LAYER, **SHAPES[shape])
    model.set_attn_implementation("sdpa")
    theirs = model.model.layers[0].self_attn
    ours = adapter_for(wrap(model)).layers[0].attention
    return ours, theirs, model.model.rotary_emb


def bench_block(shape: str, seq_len: int, total_tokens: int, device: torch.device) -> dict:
    from rl.models import mla
    from rl.models.decoder import no_cache

    ours, theirs, rotary_emb = attention_layer(shape, device)
    batch = max(1, total_tokens // seq_len)
    hidden = ours.o_proj.weight.shape[0]
    gen = torch.Generator(device=device).manual_seed(1)
    x_BLH = torch.randn(batch, seq_len, hidden, generator=gen, device=device, dtype=torch.bfloat16)
    grad_BLH = torch.randn(batch, seq_len, hidden, generator=gen, device=device, dtype=torch.bfloat16)
    positions_BL = torch.arange(seq_len, device=device).repeat(batch, 1)
    cu_seqlens = torch.arange(0, batch + 1, device=device, dtype=torch.int32) * seq_len
    x_TH, grad_TH, positions_T = x_BLH.view(-1, hidden), grad_BLH.view(-1, hidden), positions_BL.view(-1)
    position_embeddings = rotary_emb(x_BLH, positions_BL)

    def mok_fwd(x=x_TH):
        return mla.forward(ours, x, positions_T, cu_seqlens, no_cache(cu_seqlens), 0)

    def theirs_fwd(x=x_BLH):
        return theirs(x, position_embeddings, None)[0]

    x_leaf_TH, x_leaf_BLH = x_TH.clone().requires_grad_(), x_BLH.clone().requires_grad_()

    def mok_fwd_bwd():
        mok_fwd(x_leaf_TH).backward(grad_TH)

    def theirs_fwd_bwd():
        theirs_fwd(x_leaf_BLH).backward(grad_BLH)

    with torch.no_grad():
        theirs_TH = theirs_fwd().view(-1, hidden).float()
        # the absorbed form rounds other intermediates to bf16 than transformers' expanded form (docs/contracts.md)
        diff_TH = mok_fwd().float() - theirs_TH
        row = dict(kind="block", shape=shape, seq_len=seq_len, batch=batch, heads=ours.num_heads,
                   max_abs_diff_vs_transformers=diff_TH.abs().max().item(),
                   rel_diff_vs_transformers=(diff_TH.norm() / theirs_TH.norm()).item(),
                   max_abs_transformers=theirs_TH.abs().max().item(),
                   mok_fwd_ms=measure_ms(mok_fwd, device), transformers_fwd_ms=measure_ms(theirs_fwd, device))
    row["mok_fwd_bwd_ms"] = measure_ms(mok_fwd_bwd, device)
    row["transformers_fwd_bwd_ms"] = measure_ms(theirs_fwd_bwd, device)
    row["fwd_ratio"] = row["transformers_fwd_ms"] / row["mok_fwd_ms"]
    row["fwd_bwd_ratio"] = row["transformers_fwd_bwd_ms"] / row["mok_fwd_bwd_ms"]
    return row


def bench_decode(shape: str, batch: int, context: int, device: torch.device, page_size: int = 64) -> dict:
    import mok

    spec = SHAPES[shape]
    latent, rope, heads = spec["kv_lora_rank"], spec["qk_rope_head_dim"], spec["num_attention_heads"]
    gen = torch.Generator(device=device).manual_seed(2)
    pages_per_seq = -(-context // page_size)
    cache_PZ1D = torch.randn(batch * pages_per_seq, page_size, 1, latent + rope, generator=gen, device=device,
                             dtype=torch.bfloat16)
    block_table = torch.randperm(batch * pages_per_seq, generator=gen, device=device).to(torch.int32)
    block_table = block_table.view(batch, pages_per_seq)
    q_BQD = torch.randn(batch, heads, latent + rope, generator=gen, device=device, dtype=torch.bfloat16)
    cu_seqlens_q = torch.arange(batch + 1, device=device, dtype=torch.int32)
    seq_lens = torch.full((batch,), context, device=device, dtype=torch.int32)
    scale = (spec["qk_nope_head_dim"] + rope) ** -0.5

    def decode():
        return mok.paged_attention(q_BQD, cache_PZ1D, cache_PZ1D[..., :latent], cu_seqlens_q, seq_lens, block_table,
                                   scale, decode=True)

    read_bytes = batch * context * (latent + rope) * 2
    row = dict(kind="decode", shape=shape, batch=batch, context=context, page_size=page_size, heads=heads,
               kv_bytes=read_bytes, mok_decode_ms=measure_ms(decode, device))
    if device.type == "cuda":
        from mok.kernels import attention as kernels

        want = decode()
        row["configs"] = []
        for config in DECODE_CANDIDATES:
            if heads % config["PACK"]:
                continue

            def run(config=config):
                return kernels.paged_attention_forward(q_BQD, cache_PZ1D, cache_PZ1D[..., :latent], cu_seqlens_q,
                                                       seq_lens, block_table, scale, config=dict(config))[0]
            try:
                equal = torch.equal(run(), want)
                row["configs"].append(dict(config, ms=measure_ms(run, device), equal_bits=equal))
            except Exception as error:  # a tile that does not fit (registers, shared memory) is reported, not chosen
                row["configs"].append(dict(config, error=f"{type(error).__name__}: {str(error)[:160]}"))
    if device.type == "cuda":
        src = torch.empty(read_bytes // 2, dtype=torch.bfloat16, device=device)
        dst = torch.empty_like(src)
        copy_ms = measure_ms(lambda: dst.copy_(src), device)
        row["copy_tb_s"] = 2 * read_bytes / copy_ms / 1e9  # a copy reads and writes
        row["mok_decode_graph_ms"] = measure_ms(decode, device, graph=True)
        row["kv_read_bound_ms"] = read_bytes / (row["copy_tb_s"] * 1e9)
        row["ratio_to_bound"] = row["mok_decode_graph_ms"] / row["kv_read_bound_ms"]
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", default="deepseek-v3,moonlight")
    parser.add_argument("--seq-lens", default="4096,8192,16384,32768")
    parser.add_argument("--total-tokens", type=int, default=32768)
    parser.add_argument("--decode", default="64x4096", help="BATCHxCONTEXT of the decode rows ('' for none)")
    parser.add_argument("--json", default=None, help="write the summary here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    meta = dict(device=str(device), torch=torch.__version__, python=platform.python_version(),
                speedup="transformers_ms / mok_ms (fwd_ratio, fwd_bwd_ratio); decode: graph time / KV-read bound")
    if device.type == "cuda":
        import triton

        meta.update(gpu=torch.cuda.get_device_name(), triton=triton.__version__)
    print(json.dumps(dict(kind="meta", **meta)), flush=True)
    summary = dict(meta=meta, block=[], decode=[])

    def add(kind: str, row: dict) -> None:  # the summary is rewritten after every row: a cut-off run keeps its rows
        summary[kind].append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=1)

    for shape in args.shapes.split(","):
        for seq_len in [int(s) for s in args.seq_lens.split(",")]:
            add("block", bench_block(shape, seq_len, args.total_tokens, device))
        if args.decode:
            batch, context = (int(v) for v in args.decode.split("x"))
            add("decode", bench_decode(shape, batch, context, device))
    return summary


if __name__ == "__main__":
    main()
