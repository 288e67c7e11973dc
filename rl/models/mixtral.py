"""Mixtral: no q/k norm; always renormalises the top-k weights (no config flag)."""
from rl.models.base import ModelAdapter, standard_adapter


def build(model) -> ModelAdapter:
    return standard_adapter(model, "mixtral", qk_norm="none", renormalize=True)
