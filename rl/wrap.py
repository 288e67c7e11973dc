"""rl.wrap: route a transformers MoE causal LM's compute through mok's batch-invariant ops.

How (module replacement at the top, not transformers' registration points): `wrap(model)` builds a
per-architecture adapter (rl/models/<model_type>.py) that points at the model's own modules, and
replaces the instance's `forward` with one that packs the real tokens (padding removed), runs
rl/models/decoder.py over them, and scatters the logits back to [B, L, V]. Why not the attention /
experts interfaces: they see [B, heads, L, D] tensors with padding and a 4-D mask, and they leave the
norms, rotary, residual adds and linears to transformers' eager code, which is neither batch-
invariant nor the order vLLM uses; one forward that owns every step is simpler to prove equal.

What stays as it was: the module tree, parameter names and tensors (experts' gate_up_proj [E, 2I, H]
and down_proj [E, H, I] go to mok.moe as they are, no copies), state_dict, save_pretrained, .train()
/.eval(), optimisers. `model(input_ids, attention_mask)` returns a CausalLMOutputWithPast whose
logits are [B, L, V] (the parameters' dtype, zeros at padding); `labels` give the mean next-token
negative log-likelihood (ignore index -100) through mok.logprobs, or its sum over `num_items_in_batch` when
the caller passes it (transformers' Trainer does under gradient accumulation); `logits_to_keep` as in
transformers. Keywords it does not implement are refused (rl.InputError), never ignored. Differences from transformers:
positions count from each row's first real token (left padding is handled), routing is the one
definition of docs/contracts.md (Routing: fp32 weights into the combine), and there is no KV cache
(`use_cache=True`, `past_key_values`, `inputs_embeds`, `position_ids` and `cache_position` are refused: use
`rl.generate`).
Calling the inner `model.model` directly still runs transformers' own code.

Shapes: docs/shapes.md.
"""
from __future__ import annotations

import types

import torch
from torch import nn

import mok
from rl.errors import InputError
from rl.models import adapter_for
from rl.models.decoder import forward_packed, lm_head
from rl.models.packing import unpack

IGNORE_INDEX = -100


def is_wrapped(model: nn.Module) -> bool:
    return "forward" in vars(model) and getattr(model.forward, "__func__", None) is _wrapped_forward


def wrap(model: nn.Module) -> nn.Module:
    """Route `model`'s forward through mok (in place; returns the same object). Idempotent.

    model: a transformers *ForCausalLM of a supported model_type (rl.models.SUPPORTED).
    Raises rl.models.UnsupportedModelError naming what is missing otherwise. A module replaced after wrapping
    (e.g. by resize_token_embeddings) makes the next forward raise UnsupportedModelError until the model is
    wrapped again.
    """
    adapter_for(model, rebuild=True)  # validate now, so an unsupported model fails at wrap time
    if not is_wrapped(model):
        model.forward = types.MethodType(_wrapped_forward, model)
    return model


_OFF_FLAGS = ("output_attentions", "output_hidden_states", "output_router_logits")
"""Keywords transformers' forward takes that the wrapped forward accepts only switched off (None or False)."""


def _wrapped_forward(self: nn.Module, input_ids: torch.Tensor | None = None,
                     attention_mask: torch.Tensor | None = None, position_ids=None, past_key_values=None,
                     inputs_embeds=None, labels: torch.Tensor | None = None, use_cache: bool | None = None,
                     logits_to_keep: int | torch.Tensor = 0, num_items_in_batch: int | torch.Tensor | None = None,
                     return_dict: bool | None = None, cache_position=None, **kwargs):
    """input_ids [B, L] int64, attention_mask [B, L] 0/1 or None, labels [B, L] integer or None -> logits
    [B, L, V]; logits_to_keep: an int N (the last N positions, 0 = all) or a 1-D tensor of positions, as in
    transformers; num_items_in_batch: the loss is the sum over the labelled tokens divided by it (transformers'
    gradient-accumulation loss) instead of their mean."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    for name, value in (("position_ids", position_ids), ("past_key_values", past_key_values),
                        ("inputs_embeds", inputs_embeds), ("cache_position", cache_position)):
        if value is not None:
            raise InputError(f"rl.wrap: the wrapped forward does not take {name} "
                             "(positions come from attention_mask; sample with rl.generate)")
    if use_cache:
        raise InputError("rl.wrap: the wrapped forward has no KV cache; sample with rl.generate")
    if return_dict is False:
        raise InputError("rl.wrap: the wrapped forward returns a CausalLMOutputWithPast (return_dict=False is not "
                         "supported)")
    if kwargs.get("output_router_logits"):
        raise InputError("rl.wrap: the wrapped forward does not return router logits or their auxiliary loss "
                         "(output_router_logits)")
    for name, value in kwargs.items():
        if name not in _OFF_FLAGS or value:
            raise InputError(f"rl.wrap: the wrapped forward does not take {name}={value!r}")
    if input_ids is None:
        raise InputError("rl.wrap: input_ids are required")
    if labels is not None and (not isinstance(labels, torch.Tensor) or labels.shape != input_ids.shape
                               or labels.dtype.is_floating_point or labels.dtype.is_complex
                               or labels.dtype == torch.bool):
        raise InputError(f"rl.wrap: labels must be an integer tensor shaped like input_ids {tuple(input_ids.shape)}, "
                         f"got {_describe(labels)}")
    keep = _positions_to_keep(logits_to_keep)
    adapter, packed, hidden_TH = forward_packed(self, input_ids, attention_mask)
    logits_BLV = unpack(lm_head(adapter, hidden_TH), packed.real_BL)
    loss = None
    if labels is not None:
        loss = _next_token_loss(logits_BLV, labels.to(packed.real_BL.device), packed.real_BL, num_items_in_batch)
    return CausalLMOutputWithPast(loss=loss, logits=logits_BLV if keep is None else logits_BLV[:, keep])


def _describe(value) -> str:
    return f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


def _positions_to_keep(logits_to_keep) -> slice | torch.Tensor | None:
    """transformers' logits_to_keep: an int N >= 0 (the last N positions; 0 = all) or a 1-D integer tensor of
    positions. None: all."""
    if isinstance(logits_to_keep, torch.Tensor):
        if logits_to_keep.dim() != 1 or logits_to_keep.dtype.is_floating_point or logits_to_keep.dtype == torch.bool:
            raise InputError(f"rl.wrap: logits_to_keep must be an int or a 1-D integer tensor of positions, got "
                             f"{_describe(logits_to_keep)}")
        return logits_to_keep
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
        raise InputError(f"rl.wrap: logits_to_keep must be an int >= 0 or a 1-D tensor, got {logits_to_keep!r}")
    return None if logits_to_keep == 0 else slice(-logits_to_keep, None)


def _next_token_loss(logits_BLV: torch.Tensor, labels_BL: torch.Tensor, real_BL: torch.Tensor,
                     num_items_in_batch: int | torch.Tensor | None = None) -> torch.Tensor:
    """-log p(labels[:, t+1]) over positions t whose label is not IGNORE_INDEX (transformers' shift): their mean,
    or their sum / num_items_in_batch when given (transformers' loss under gradient accumulation)."""
    targets_BL = labels_BL[:, 1:]
    keep_BL = (targets_BL != IGNORE_INDEX) & real_BL[:, :-1]
    vocab = logits_BLV.shape[-1]
    if labels_BL.device.type == "cpu" and bool(((targets_BL[keep_BL] < 0) | (targets_BL[keep_BL] >= vocab)).any()):
        raise InputError(f"rl.wrap: labels must lie in [0, {vocab}) or be {IGNORE_INDEX} (ignored)")
    logprobs_N = mok.logprobs(logits_BLV[:, :-1][keep_BL], targets_BL[keep_BL].to(torch.int64))
    if num_items_in_batch is None:
        return -logprobs_N.sum() / keep_BL.sum().clamp(min=1)
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(logprobs_N.device)
    return -logprobs_N.sum() / num_items_in_batch
