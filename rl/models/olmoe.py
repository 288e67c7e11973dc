"""OLMoE: q/k RMSNorm over the WHOLE projection (all heads at once, before the head split and
rotary), optional `clip_qkv` clamp; top-k weights not renormalised (`norm_topk_prob` False)."""
from rl.models.base import ModelAdapter, standard_adapter


def build(model) -> ModelAdapter:
    return standard_adapter(model, "olmoe", qk_norm="whole", renormalize=bool(model.config.norm_topk_prob))
