"""Qwen3-MoE: per-head q/k RMSNorm (over head_dim, before rotary); renormalises the top-k weights
when `norm_topk_prob` (True in the released checkpoints); dense MLP on `mlp_only_layers`."""
from rl.models.base import ModelAdapter, standard_adapter


def build(model) -> ModelAdapter:
    return standard_adapter(model, "qwen3_moe", qk_norm="per_head", renormalize=bool(model.config.norm_topk_prob))
