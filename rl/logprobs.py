"""rl.logprobs: per-token log-probabilities of given sequences, the trainer's side of the agreement.

Shapes: docs/shapes.md.
"""
from __future__ import annotations

import math
import numbers

import torch

import mok
from rl import trace_names
from rl.models.decoder import forward_packed, lm_head
from rl.models.packing import check_has_data, unpack

GREEDY_TEMPERATURE = 1e-5
"""vLLM samples greedily (and reports log-probabilities of the raw logits) below this temperature."""


def sampling_temperature(value) -> bool:
    """A temperature vLLM samples at (not greedily): a finite number >= GREEDY_TEMPERATURE (NaN and inf are not,
    and vLLM refuses them only once it has started)."""
    return (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
            and value >= GREEDY_TEMPERATURE)


def logprobs(model: torch.nn.Module, input_ids: torch.Tensor,
             attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """log p(input_ids[:, t+1] | input_ids[:, :t+1]) for every t, computed through mok's ops.

    model: a supported transformers MoE causal LM (wrapped by `rl.wrap` or not; the same ops run).
    input_ids: [B, L] int64 (moved to the model's device). attention_mask: [B, L] 0/1 or None; each
    row's real tokens must be contiguous (left or right padding); positions count from each row's
    first real token.
    Returns fp32 [B, L-1]; entry t is 0.0 unless tokens t and t+1 are both real. Differentiable
    (deterministic backward); bitwise equal to what `rl.generate` reports for the same tokens.
    Only the rows that have a successor go through lm_head and log-softmax.
    A model sharded by rl.distributed.shard (FSDP2) runs the same body inside FSDP's forward hooks.
    Raises rl.InputError for ids or a mask that are not dense tensors holding data (meta device, sparse
    layout), of the wrong shape or dtype, or with ids outside the vocabulary; rl.UnsupportedModelError
    for a model rl cannot run.
    """
    check_has_data(input_ids, "input_ids")
    check_has_data(attention_mask, "attention_mask")
    sharded = getattr(model, "_mok_sharded_logprobs", None)  # set by rl.distributed.shard
    if sharded is not None:
        return sharded(input_ids, attention_mask)
    return packed_logprobs(model, input_ids, attention_mask)


def packed_logprobs(model: torch.nn.Module, input_ids: torch.Tensor,
                    attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The body of `logprobs` (same arguments and result), reading the model's parameters as they are."""
    adapter, packed, hidden_TH = forward_packed(model, input_ids, attention_mask)
    rows = torch.nonzero(packed.has_next_T).squeeze(1)
    logits_TV = lm_head(adapter, hidden_TH[rows])
    logprobs_T = mok.logprobs(logits_TV, packed.input_ids_T[rows + 1], name=trace_names.LOGPROBS)
    has_next_BL = torch.zeros_like(packed.real_BL)
    has_next_BL[packed.real_BL] = packed.has_next_T
    return unpack(logprobs_T, has_next_BL)[:, :-1]
