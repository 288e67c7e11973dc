"""rl.generate: a small reference sampler with a KV cache, decoding in batches through mok's ops.

It is the sampler side of the agreement proof where vLLM is not installed (the CUDA install of `./run`) and a
test oracle: prompts are prefilled together (varlen, padding never materialised), then decoded one
token per sequence per step against rl/kv_cache.py, every step through the same decoder forward as
the trainer (rl/models/decoder.py). Log-probabilities are those of the raw logits (before
temperature and top-k, like vLLM's), through mok.logprobs.

Sampling is deterministic and per sequence: sequence i draws from its own torch.Generator seeded
with seeds[i], one draw of V exponentials per token on the CPU, and picks
argmax(logits / temperature - log(E)) (Gumbel-max) in fp32; so a prompt's tokens do not depend on the
batch it was sampled in, and the random numbers never touch the log-probabilities.

Shapes: docs/shapes.md.
"""
from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass

import torch

import mok
from rl import trace_names
from rl.errors import InputError
from rl.kv_cache import KVCache
from rl.models import adapter_for
from rl.models.decoder import check_materialised, forward_hidden, lm_head


@dataclass(frozen=True)
class Generation:
    """prompts[i] + tokens[i] is sequence i; logprobs[i] (fp32, CPU, [len(tokens[i])]) are the log-probs
    of tokens[i] under the raw logits."""

    prompts: list[list[int]]
    tokens: list[list[int]]
    logprobs: list[torch.Tensor]

    def sequences(self) -> list[list[int]]:
        return [prompt + tokens for prompt, tokens in zip(self.prompts, self.tokens)]

    def padded(self, pad_token_id: int = 0, left: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids [B, L] int64, attention_mask [B, L] int64, completion_mask [B, L-1] bool) for
        rl.logprobs: completion_mask marks the entries of rl.logprobs' output that score sampled tokens,
        in order, so `rl.logprobs(...)[completion_mask]` lines up with `torch.cat(self.logprobs)`.
        pad_token_id: an int; left: a bool (rl.InputError otherwise). No sequences: [0, 0] tensors."""
        pad_token_id = _count("pad_token_id", pad_token_id, minimum=None, where="padded")
        if not isinstance(left, bool):
            raise InputError(f"padded: left must be True or False, got {left!r}")
        sequences = self.sequences()
        if not sequences:
            return (torch.zeros((0, 0), dtype=torch.int64), torch.zeros((0, 0), dtype=torch.int64),
                    torch.zeros((0, 0), dtype=torch.bool))
        width = max(len(s) for s in sequences)
        input_ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.int64)
        attention_mask = torch.zeros((len(sequences), width), dtype=torch.int64)
        completion_mask = torch.zeros((len(sequences), width), dtype=torch.bool)
        for row, (prompt, sequence) in enumerate(zip(self.prompts, sequences)):
            start = width - len(sequence) if left else 0
            input_ids[row, start:start + len(sequence)] = torch.tensor(sequence, dtype=torch.int64)
            attention_mask[row, start:start + len(sequence)] = 1
            # entry t of rl.logprobs scores token t+1: the first sampled token sits at len(prompt).
            completion_mask[row, start + len(prompt) - 1:start + len(sequence) - 1] = True
        return input_ids, attention_mask, completion_mask[:, :-1]


def _choose(logits_V: torch.Tensor, generator: torch.Generator | None, temperature: float, top_k: int | None) -> int:
    scores_V = logits_V.detach().to(device="cpu", dtype=torch.float32)
    if top_k is not None and top_k < scores_V.numel():
        threshold = torch.topk(scores_V, top_k).values[-1]
        scores_V = torch.where(scores_V >= threshold, scores_V, torch.full_like(scores_V, float("-inf")))
    if temperature == 0.0:
        return int(torch.argmax(scores_V))
    exponential_V = torch.empty(scores_V.shape, dtype=torch.float32).exponential_(generator=generator)
    return int(torch.argmax(scores_V / temperature - torch.log(exponential_V)))


def _count(label: str, value, minimum: int | None, where: str = "generate") -> int:
    """An int argument (not a bool, not a float; numpy and 0-d integer tensors are ints) >= minimum."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise InputError(f"{where}: {label} must be an int, got {value!r}") from None
    if minimum is not None and number < minimum:
        raise InputError(f"{where}: {label} must be >= {minimum}, got {number}")
    return number


_SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed accepts


def _seeds(seed, count: int) -> list[int]:
    """seed: one int (sequence i uses seed + i) or one int per prompt -> the seeds, checked."""
    try:
        single = not isinstance(seed, bool) and operator.index(seed) is not None
    except TypeError:
        single = False
    if not single and not isinstance(seed, (str, bytes, bool)) and hasattr(seed, "__iter__"):
        seeds = [_count("seed", s, minimum=None) for s in seed]
        if len(seeds) != count:
            raise InputError(f"generate: {len(seeds)} seeds for {count} prompts (seed: one int, or one per prompt)")
    else:
        first = _count("seed", seed, minimum=None)
        seeds = [first + i for i in range(count)]
    if seeds and not (_SEED_RANGE[0] <= min(seeds) and max(seeds) <= _SEED_RANGE[1]):
        raise InputError(f"generate: seed values must lie in [{_SEED_RANGE[0]}, {_SEED_RANGE[1]}], got "
                         f"{min(seeds)}..{max(seeds)}")
    return seeds


def _token_id(value) -> int:
    """An integer token id (operator.index: numpy and 0-d integer tensors too), never a bool."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise TypeError(f"{value!r} is a bool")
    return operator.index(value)


def generate(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, seed: int | list[int] = 0, batch_size: int | None = None,
             eos_token_id: int | None = None) -> Generation:
    """Sample up to `max_new_tokens` tokens after each prompt.

    model: a supported transformers MoE causal LM (wrapped or not). prompts: token ids, each non-empty.
    max_new_tokens: an int >= 0. temperature: a finite number >= 0, 0 for greedy. top_k: an int >= 1,
    keep the k highest logits (ties at the k-th are kept), or None. seed: one int (sequence i uses
    seed + i) or a list of one int per prompt, within torch's seed range. batch_size: an int >= 1, prompts
    decoded together, or None (all). eos_token_id: an int or None; a sequence stops after sampling it
    (it is kept in tokens). Ints may be any integer type (numpy, `operator.index`), never bool or float.
    Returns a Generation (empty for no prompts); runs without gradients. Raises rl.InputError for bad
    arguments (any of the above out of its type or range, an empty prompt, token ids outside the
    vocabulary, ...), before any work; rl.UnsupportedModelError for a model rl cannot run (unsupported,
    or parameters on the meta device).
    """
    max_new_tokens = _count("max_new_tokens", max_new_tokens, minimum=0)
    if (isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not math.isfinite(temperature)
            or temperature < 0):
        raise InputError(f"generate: temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    temperature = float(temperature)
    top_k = None if top_k is None else _count("top_k", top_k, minimum=1)
    batch_size = None if batch_size is None else _count("batch_size", batch_size, minimum=1)
    if eos_token_id is not None:
        eos_token_id = _count("eos_token_id", eos_token_id, minimum=None)
    if not isinstance(prompts, (list, tuple)) or any(isinstance(p, (str, bytes)) for p in prompts):
        raise InputError("generate: prompts must be a list of token-id sequences")
    try:
        prompts = [[_token_id(t) for t in p] for p in prompts]
    except TypeError as error:
        raise InputError(f"generate: prompt token ids must be integers ({error})") from None
    if any(len(p) == 0 for p in prompts):
        raise InputError("generate: every prompt needs at least one token")
    seeds = _seeds(seed, len(prompts))
    adapter = adapter_for(model)
    check_materialised(adapter)
    vocab = min(adapter.lm_head.weight.shape[0], adapter.embed.weight.shape[0])
    if any(t < 0 or t >= vocab for p in prompts for t in p):
        raise InputError(f"generate: prompt token ids must lie in [0, {vocab})")
    batch_size = batch_size or max(len(prompts), 1)  # None: all prompts together
    tokens: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[torch.Tensor]] = [[] for _ in prompts]
    with torch.no_grad():
        for first in range(0, len(prompts), batch_size):
            group = list(range(first, min(first + batch_size, len(prompts))))
            _generate_group(adapter, prompts, group, max_new_tokens, temperature, top_k, seeds, eos_token_id,
                            tokens, logprobs)
    return Generation(
        prompts=[list(p) for p in prompts],
        tokens=tokens,
        logprobs=[torch.cat(lp) if lp else torch.zeros(0, dtype=torch.float32) for lp in logprobs],
    )


def _generate_group(adapter, prompts, group, max_new_tokens, temperature, top_k, seeds, eos_token_id,
                    tokens, logprobs) -> None:
    if max_new_tokens == 0:
        return
    weight = adapter.embed.weight
    device = weight.device
    attention = adapter.layers[0].attention
    cache = KVCache(len(adapter.layers), attention.num_kv_heads, attention.head_dim, weight.dtype, device,
                    getattr(attention, "value_head_dim", None))
    generators = {i: torch.Generator().manual_seed(seeds[i]) for i in group}
    for i in group:
        cache.add_sequence(i, len(prompts[i]) + max_new_tokens)

    # Prefill: all prompts of the group at once, each a varlen sequence.
    active = list(group)
    lengths = [len(prompts[i]) for i in active]
    input_ids_T = torch.tensor([t for i in active for t in prompts[i]], dtype=torch.int64, device=device)
    positions_T = torch.cat([torch.arange(n, dtype=torch.int64) for n in lengths]).to(device)
    cu_seqlens_q = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    while True:
        keys_values, commit = cache.step(active, lengths)
        hidden_TH = forward_hidden(adapter, input_ids_T, positions_T, cu_seqlens_q, keys_values)
        commit()
        logits_BV = lm_head(adapter, hidden_TH[cu_seqlens_q[1:].long() - 1])
        chosen = [_choose(logits_BV[row], generators[i], temperature, top_k) for row, i in enumerate(active)]
        chosen_B = torch.tensor(chosen, dtype=torch.int64, device=device)
        logprobs_B = mok.logprobs(logits_BV, chosen_B, name=trace_names.LOGPROBS).cpu()
        still_active = []
        for row, i in enumerate(active):
            tokens[i].append(chosen[row])
            logprobs[i].append(logprobs_B[row:row + 1])
            if len(tokens[i]) < max_new_tokens and chosen[row] != eos_token_id:
                still_active.append((i, chosen[row]))
            else:
                cache.drop(i)
        if not still_active:
            return
        active = [i for i, _ in still_active]
        lengths = [1] * len(active)
        input_ids_T = torch.tensor([t for _, t in still_active], dtype=torch.int64, device=device)
        positions_T = torch.tensor([cache.length(i) for i in active], dtype=torch.int64, device=device)
        cu_seqlens_q = torch.arange(len(active) + 1, dtype=torch.int32, device=device)
