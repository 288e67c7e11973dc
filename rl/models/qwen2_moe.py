"""Qwen2-MoE: q/k/v biases, no q/k norm; a shared expert (SwiGLU MLP) scaled by
sigmoid(shared_expert_gate(x)) and added to the routed experts' output."""
from rl.models.base import ModelAdapter, standard_adapter


def build(model) -> ModelAdapter:
    return standard_adapter(model, "qwen2_moe", qk_norm="none",
                            renormalize=bool(model.config.norm_topk_prob), shared_expert=True)
