"""Dense-op benchmark (GPU): mok's batch-invariant Triton ops vs the plain torch op, same run, as ratios.

Usage: PYTHONPATH=. python bench/dense.py [--out results.jsonl]
Prints and writes one JSON line per (op, tokens): ms for mok and torch, and mok/torch time ratio.
Shapes: Qwen3-30B-A3B-like dense parts (hidden 2048, 32 q heads / 4 kv heads of 128, vocab 151936).
"""
from __future__ import annotations

import argparse
import json

import torch

import mok
from bench.timing import cuda_ms
from mok.ops.logprobs import log_softmax


def _cases(tokens: int):
    """(op, mok call, torch call) at `tokens` tokens. Shapes: docs/shapes.md."""
    dev, bf16 = "cuda", torch.bfloat16
    x_TF = torch.randn(tokens, 2048, device=dev, dtype=bf16)
    w_qkv_OF = torch.randn(5120, 2048, device=dev, dtype=bf16) * 0.02
    w_head_VF = torch.randn(151936, 2048, device=dev, dtype=bf16) * 0.02
    norm_w_F = torch.ones(2048, device=dev, dtype=bf16)
    q_TQD = torch.randn(tokens, 32, 128, device=dev, dtype=bf16)
    kv_SGD = torch.randn(tokens, 4, 128, device=dev, dtype=bf16)
    pos_T = torch.arange(tokens, device=dev)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device=dev)
    logits_TV = torch.randn(min(tokens, 2048), 151936, device=dev, dtype=bf16)
    yield "linear_qkv", lambda: mok.linear(x_TF, w_qkv_OF), lambda: x_TF @ w_qkv_OF.t()
    yield "lm_head", lambda: mok.linear(x_TF, w_head_VF), lambda: x_TF @ w_head_VF.t()
    yield "rms_norm", lambda: mok.rms_norm(x_TF, norm_w_F, 1e-6), \
        lambda: torch.nn.functional.rms_norm(x_TF, (2048,), norm_w_F, 1e-6)
    yield "rotary", lambda: mok.rotary(q_TQD, pos_T, 1e6), lambda: q_TQD * 1.0
    yield "log_softmax", lambda: log_softmax(logits_TV), lambda: logits_TV.float().log_softmax(-1)
    q_1QTD, k_1QSD = q_TQD.transpose(0, 1)[None], kv_SGD.transpose(0, 1)[None].repeat_interleave(8, 1)
    yield "attention_prefill", lambda: mok.attention(q_TQD, kv_SGD, kv_SGD, cu, cu, 128**-0.5), \
        lambda: torch.nn.functional.scaled_dot_product_attention(q_1QTD, k_1QSD, k_1QSD, is_causal=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--tokens", type=int, nargs="*", default=[1, 64, 4096])
    args = parser.parse_args()
    rows = []
    for tokens in args.tokens:
        for op, ours, baseline in _cases(tokens):
            ms, base_ms = cuda_ms(ours, warmup=1, iters=20), cuda_ms(baseline, warmup=1, iters=20)
            row = dict(op=op, tokens=tokens, ms=round(ms, 4), torch_ms=round(base_ms, 4), ratio=round(ms / base_ms, 3),
                       gpu=torch.cuda.get_device_name(), torch=torch.__version__)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
