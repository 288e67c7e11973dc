"""The whole trainer step: one `rl.logprobs` forward + backward through mok against plain transformers
(SDPA attention) on the same weights, same run, one GPU.

Model: a Qwen3-30B-A3B-shaped slice (hidden 2048, 32 query / 4 key-value heads of 128, 128 experts,
top-8, expert width 768, vocab 151936), 4 layers, random bf16 weights. Configurations: batch x length
8 x 4096, 2 x 16384, 1 x 32768 (no padding). Each side computes fp32 log-probabilities of the next
tokens and back-propagates their sum. Writes JSON lines and bench/results/step-latest.json
(per configuration `mok_tokens_per_s`, `transformers_tokens_per_s`, `ratio`, peak memory of each, and each side's
model-FLOPs utilisation `mfu` / `transformers_mfu`: `step_flops` / time / H200_BF16_DENSE_FLOPS).

    python -m bench.step --json bench/results/step-latest.json
"""
from __future__ import annotations

import argparse
import gc
import json
import platform

import torch

import rl
from bench.timing import cuda_ms
from rl.testing import tiny_model

QWEN3_30B_A3B_LAYERS = dict(
    hidden_size=2048, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
    vocab_size=151936, max_position_embeddings=32768, initializer_range=0.02, norm_topk_prob=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)

H200_BF16_DENSE_FLOPS = 989e12
"""The H100/H200 SXM dense bf16 tensor-core peak (FLOP/s) that `mfu` divides by."""


def step_flops(config: dict, batch: int, length: int) -> float:
    """Model FLOPs of one forward + backward of `batch` causal sequences of `length` tokens with a Qwen3-MoE
    `config` (the keys of QWEN3_30B_A3B_LAYERS): the matrix products the model defines, once each, recomputation
    not counted. Forward: 2 FLOPs per multiply-add of the q/k/v/o projections, the router, the top-k experts'
    gate/up/down, lm_head over every position, and causal attention (scores and values over the L(L+1)/2 query-key
    pairs of each head); the backward is twice the forward (input and weight gradients), so the step is 3x."""
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    per_token = (hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
                 + hidden * config["num_experts"]  # router
                 + config["num_experts_per_tok"] * 3 * hidden * config["moe_intermediate_size"])
    pairs = length * (length + 1) // 2
    forward = (2 * config["num_hidden_layers"] * (per_token * length + 2 * heads * head_dim * pairs)
               + 2 * hidden * config["vocab_size"] * length) * batch
    return 3.0 * forward


def _transformers_logprobs(model: torch.nn.Module, input_ids_BL: torch.Tensor) -> torch.Tensor:
    logits_BLV = model(input_ids=input_ids_BL).logits[:, :-1].float()
    return torch.log_softmax(logits_BLV, -1).gather(-1, input_ids_BL[:, 1:, None])[..., 0]


def _measure(step, iters: int) -> tuple[float, float]:
    """-> (ms per step, peak GiB above the memory held before the step)."""
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ms = cuda_ms(step, warmup=0, iters=iters)
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**30


def bench(batch: int, length: int, plain: torch.nn.Module, wrapped: torch.nn.Module, iters: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(batch * length)
    input_ids_BL = torch.randint(3, QWEN3_30B_A3B_LAYERS["vocab_size"], (batch, length), device="cuda", generator=gen)
    mask_BL = torch.ones_like(input_ids_BL)
    row = dict(batch=batch, length=length, tokens=batch * length)

    def mok_step():
        wrapped.zero_grad(set_to_none=True)
        rl.logprobs(wrapped, input_ids_BL, mask_BL).sum().backward()

    def transformers_step():
        plain.zero_grad(set_to_none=True)
        _transformers_logprobs(plain, input_ids_BL).sum().backward()

    for side, step, model in (("transformers", transformers_step, plain), ("mok", mok_step, wrapped)):
        try:
            ms, peak = _measure(step, iters)
            row[f"{side}_ms"] = ms
            row[f"{side}_tokens_per_s"] = batch * length / ms * 1e3
            row[f"{side}_peak_gib"] = peak
            row["mfu" if side == "mok" else f"{side}_mfu"] = (
                step_flops(QWEN3_30B_A3B_LAYERS, batch, length) / (ms / 1e3) / H200_BF16_DENSE_FLOPS)
        except torch.OutOfMemoryError as error:
            row[f"{side}_error"] = f"out of memory: {str(error).splitlines()[0]}"
            row[f"{side}_tokens_per_s"] = None
        model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        row[f"{side}_left_allocated_gib"] = torch.cuda.memory_allocated() / 2**30
    if row.get("mok_tokens_per_s") and row.get("transformers_tokens_per_s"):
        row["ratio"] = row["mok_tokens_per_s"] / row["transformers_tokens_per_s"]
    else:
        row["ratio"] = None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="8x4096,2x16384,1x32768")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import transformers
    import triton

    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                transformers=transformers.__version__, python=platform.python_version(), model="qwen3-30b-a3b 4 layers")
    print(json.dumps(dict(kind="meta", **meta)), flush=True)
    plain = tiny_model("qwen3_moe", seed=0, device="cuda", **QWEN3_30B_A3B_LAYERS)
    plain.set_attn_implementation("sdpa")
    plain.train()
    wrapped = rl.wrap(tiny_model("qwen3_moe", seed=0, device="cuda", **QWEN3_30B_A3B_LAYERS))
    wrapped.train()
    rows = []
    for config in args.configs.split(","):
        batch, length = (int(x) for x in config.split("x"))
        rows.append(bench(batch, length, plain, wrapped, args.iters))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, configs=rows), f, indent=1)


if __name__ == "__main__":
    main()
