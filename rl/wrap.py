"""rl.wrap: route a transformers MoE causal LM's compute through mok's batch-invariant ops.

How (module replacement at the top, not transformers' registration points): `wrap(model)` builds a
per-architecture adapter (rl/models/<model_type>.py) that points at the model's own modules, and
replaces the instance's `forward` with one that packs the real tokens (padding removed), runs
rl/models/decoder.py over them, and scatters the logits back to [B, S, V]. Why not the attention /
experts interfaces: they see [B, heads, S, D] tensors with padding and a 4-D mask, and they leave the
norms, rotary, residual adds and linears to transformers' eager code, which is neither batch-
invariant nor the order vLLM uses; one forward that owns every step is simpler to prove equal.

What stays as it was: the module tree, parameter names and tensors (experts' gate_up_proj [E, 2I, H]
and down_proj [E, H, I] go to mok.moe as they are, no copies), state_dict, save_pretrained, .train()
/.eval(), optimisers. `model(input_ids, attention_mask)` returns a CausalLMOutputWithPast whose
logits are [B, S, V] (the parameters' dtype, zeros at padding); `labels` give the mean next-token
negative log-likelihood (ignore index -100) through mok.logprobs. Differences from transformers:
positions count from each row's first real token (left padding is handled), routing is DESIGN.md's
one definition (fp32 weights into the combine), and there is no KV cache (`use_cache`,
`past_key_values`, `inputs_embeds` and `position_ids` are refused: use `rl.generate` to sample).
Calling the inner `model.model` directly still runs transformers' own code.

Legend: B rows, S padded length, T packed real tokens, V vocabulary.
"""
from __future__ import annotations

import types

import torch
from torch import nn

import mok
from mok.errors import UnsupportedError
from rl.models import adapter_for
from rl.models.decoder import forward_packed, lm_head
from rl.models.packing import unpack

IGNORE_INDEX = -100


def is_wrapped(model: nn.Module) -> bool:
    return "forward" in vars(model) and getattr(model.forward, "__func__", None) is _wrapped_forward


def wrap(model: nn.Module) -> nn.Module:
    """Route `model`'s forward through mok (in place; returns the same object). Idempotent.

    model: a transformers *ForCausalLM of a supported model_type (rl.models.SUPPORTED).
    Raises rl.models.UnsupportedModelError naming what is missing otherwise.
    """
    adapter_for(model)  # validate now, so an unsupported model fails at wrap time
    if not is_wrapped(model):
        model.forward = types.MethodType(_wrapped_forward, model)
    return model


def _wrapped_forward(self: nn.Module, input_ids: torch.Tensor | None = None,
                     attention_mask: torch.Tensor | None = None, position_ids=None, past_key_values=None,
                     inputs_embeds=None, labels: torch.Tensor | None = None, use_cache: bool | None = None,
                     logits_to_keep: int = 0, **kwargs):
    """input_ids [B, S] int64, attention_mask [B, S] 0/1 or None, labels [B, S] or None -> logits [B, S, V]."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    for name, value in (("position_ids", position_ids), ("past_key_values", past_key_values),
                        ("inputs_embeds", inputs_embeds)):
        if value is not None:
            raise UnsupportedError(f"rl.wrap: the wrapped forward does not take {name} "
                                   "(positions come from attention_mask; sample with rl.generate)")
    if use_cache:
        raise UnsupportedError("rl.wrap: the wrapped forward has no KV cache; sample with rl.generate")
    if input_ids is None:
        raise UnsupportedError("rl.wrap: input_ids are required")
    adapter, packed, hidden_TH = forward_packed(self, input_ids, attention_mask)
    logits_BSV = unpack(lm_head(adapter, hidden_TH), packed.real_BS)
    loss = None if labels is None else _next_token_loss(logits_BSV, labels.to(packed.real_BS.device), packed.real_BS)
    if logits_to_keep:
        logits_BSV = logits_BSV[:, -logits_to_keep:]
    return CausalLMOutputWithPast(loss=loss, logits=logits_BSV)


def _next_token_loss(logits_BSV: torch.Tensor, labels_BS: torch.Tensor, real_BS: torch.Tensor) -> torch.Tensor:
    """Mean of -log p(labels[:, t+1]) over positions t whose label is not IGNORE_INDEX (transformers' shift)."""
    targets_BS = labels_BS[:, 1:]
    keep_BS = (targets_BS != IGNORE_INDEX) & real_BS[:, :-1]
    logprobs_N = mok.logprobs(logits_BSV[:, :-1][keep_BS], targets_BS[keep_BS].to(torch.int64))
    return -logprobs_N.sum() / keep_BS.sum().clamp(min=1)
