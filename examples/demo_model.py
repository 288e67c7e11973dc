"""The demo's model and task: a random-init Qwen3-MoE built locally, and a verifiable copy task.

Model (no downloads; transformers' Qwen3MoeConfig, bf16, weights drawn from a seeded generator):

| size  | hidden | layers | heads q/kv | head_dim | experts | top-k | expert I | vocab |
|-------|--------|--------|------------|----------|---------|-------|----------|-------|
| cpu   | 64     | 2      | 4 / 2      | 32       | 8       | 2     | 32       | 64    |
| gpu   | 512    | 4      | 8 / 4      | 64       | 32      | 4     | 256      | 64    |

head_dim 32/64 and hidden a multiple of 32 keep vLLM's CPU backend happy.

Task (copy): a prompt is [BOS, d1 .. dn, SEP] with digits d in DIGITS; the completion should repeat
d1 .. dn. Reward per position = 1.0 for the right digit, 0.1 for another digit, 0 for anything else;
reward per completion = their mean — checked exactly on token ids, no model involved. Rewards are
computed from integer counts, so completions that score the same get bit-identical rewards (the GRPO
advantage of a group whose rewards are all equal must be exactly 0, not fp32 rounding noise).
Prompts are balanced: at every position, the digits across a step's prompts run through shuffled
copies of all ten digits, so with a multiple of ten prompts each digit appears equally often at each
position and the per-step mean reward measures the policy, not the luck of the prompt draw.

Shapes: docs/shapes.md.
"""
from __future__ import annotations

import torch

PAD, BOS, EOS, SEP = 0, 1, 2, 3
FIRST_DIGIT = 4
NUM_DIGITS = 10
DIGITS = range(FIRST_DIGIT, FIRST_DIGIT + NUM_DIGITS)
VOCAB = 64  # a multiple of 64: vLLM pads the lm_head to one, and the traced logits rows must match

SIZES: dict[str, dict] = {
    "cpu": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128),
    "gpu": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256, intermediate_size=1024),
}


def demo_config(size: str = "cpu"):
    """A transformers Qwen3MoeConfig for the demo model of `size` ('cpu' or 'gpu', see the module table)."""
    from rl.testing import tiny_config

    if size not in SIZES:
        raise ValueError(f"unknown demo model size {size!r}; choose one of {', '.join(SIZES)}")
    # tiny_config's qwen3_moe: 2 layers, silu, rms eps 1e-6, untied, init std 0.05, norm_topk_prob, every
    # layer MoE; the demo's vocabulary, special tokens, context and size on top.
    return tiny_config("qwen3_moe", vocab_size=VOCAB, max_position_embeddings=256, bos_token_id=BOS,
                       eos_token_id=EOS, pad_token_id=PAD, **SIZES[size])


def demo_model(size: str = "cpu", seed: int = 0, device: str | torch.device = "cpu"):
    """A randomly initialised Qwen3MoeForCausalLM (bf16, train mode); the same seed gives the same weights.

    Weights are drawn in fp32 on the CPU from one generator in sorted parameter-name order (norm
    weights around 1, the rest normal with std 0.05), so they are the same on every device.
    """
    import transformers

    config = demo_config(size)
    model = transformers.Qwen3MoeForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            values = torch.randn(parameter.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight"):
                values = 1.0 + 0.1 * values
            else:
                values = config.initializer_range * values
            parameter.copy_(values)
    return model.to(device=device, dtype=torch.bfloat16)


def copy_prompts(count: int, length: int, generator: torch.Generator) -> list[list[int]]:
    """`count` prompts [BOS, d1..d_length, SEP]. Column j (the j-th digits of all prompts) is the start of
    ceil(count / NUM_DIGITS) random permutations of the digits, drawn from `generator`: balanced."""
    rounds = -(-count // NUM_DIGITS)
    columns = [torch.cat([torch.randperm(NUM_DIGITS, generator=generator) for _ in range(rounds)])[:count]
               for _ in range(length)]
    return [[BOS, *(FIRST_DIGIT + int(column[i]) for column in columns), SEP] for i in range(count)]


def copy_position_rewards(prompt: list[int], completion: list[int]) -> list[float]:
    """One reward per prompt digit: 1.0 (right digit at that position), 0.1 (another digit), 0 (other or
    missing)."""
    target = prompt[1:-1]
    scores = []
    for position, want in enumerate(target):
        got = completion[position] if position < len(completion) else None
        scores.append(1.0 if got == want else 0.1 if got in DIGITS else 0.0)
    return scores


def copy_reward(prompt: list[int], completion: list[int]) -> float:
    """Mean of copy_position_rewards, from integer counts (10 per right digit, 1 per other digit) so that
    equal outcomes give bit-identical floats whatever the positions."""
    tenths = sum(round(10 * score) for score in copy_position_rewards(prompt, completion))
    return tenths / (10 * (len(prompt) - 2))
