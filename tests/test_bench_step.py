"""bench/step.py's model FLOPs (its `mfu`): equal to what torch's FLOP counter counts for a real forward + backward
of a tiny transformers Qwen3-MoE, once the counter's attention (every query-key pair) is made causal."""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from bench.step import step_flops
from rl.testing import tiny_model

CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, vocab_size=96)


@pytest.mark.parametrize("batch, length", [(1, 1), (3, 11), (2, 37)])
def test_step_flops_are_the_counted_matrix_products(batch, length):
    model = tiny_model("qwen3_moe", seed=0, **CONFIG)
    model.set_attn_implementation("eager")  # attention as bmm, which the counter sees
    model.set_experts_implementation("eager")  # experts as per-expert mm (the counter skips grouped_mm)
    input_ids = torch.randint(0, CONFIG["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=input_ids).logits.float().sum().backward()
    counts = counter.get_flop_counts()["Global"]
    attention_all_pairs = counts[torch.ops.aten.bmm]
    causal = attention_all_pairs * (length * (length + 1) // 2) // (length * length)
    assert set(counts) == {torch.ops.aten.mm, torch.ops.aten.bmm}
    assert step_flops(CONFIG, batch, length) == counter.get_total_flops() - attention_all_pairs + causal
