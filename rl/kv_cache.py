"""A per-sequence KV cache for the reference sampler: plain tensors, no paging.

Each sequence owns, per layer, K and V buffers [capacity, G, D] filled from position 0. A decode
step appends each sequence's new keys/values and hands mok.attention all of the batch's keys packed
one sequence after another, with cu_seqlens_k, so a query reduces over exactly its own sequence's
keys from position 0 (the same key blocks as in a whole-sequence forward).

Shapes: docs/shapes.md.
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 value_head_dim: int | None = None):
        """value_head_dim: the values' head dim when it differs from the keys' (MLA's latent values)."""
        self.num_layers = num_layers
        self._shape = (num_kv_heads, head_dim)
        self._value_shape = (num_kv_heads, head_dim if value_head_dim is None else value_head_dim)
        self._dtype = dtype
        self._device = device
        self._keys: dict[int, list[torch.Tensor]] = {}  # sequence id -> per layer [capacity, G, D]
        self._values: dict[int, list[torch.Tensor]] = {}
        self._lengths: dict[int, int] = {}  # sequence id -> tokens stored (in every layer after a step)

    def add_sequence(self, sequence: int, capacity: int) -> None:
        """Reserve buffers for `capacity` tokens of a new sequence id."""
        if sequence in self._lengths:
            raise ValueError(f"sequence {sequence} is already in the cache")
        make = lambda shape: [torch.empty((capacity, *shape), dtype=self._dtype, device=self._device)  # noqa: E731
                              for _ in range(self.num_layers)]
        self._keys[sequence], self._values[sequence] = make(self._shape), make(self._value_shape)
        self._lengths[sequence] = 0

    def drop(self, sequence: int) -> None:
        del self._keys[sequence], self._values[sequence], self._lengths[sequence]

    def length(self, sequence: int) -> int:
        return self._lengths[sequence]

    def step(self, sequences: list[int], new_tokens: list[int]):
        """A key/value source (see rl.models.decoder.KeyValueSource) for one forward over `sequences`,
        which bring `new_tokens[i]` tokens each (packed in that order); lengths advance after the forward
        with `commit()`."""
        starts = [self._lengths[s] for s in sequences]
        ends = [start + n for start, n in zip(starts, new_tokens)]
        device = self._device
        cu_k = torch.tensor([0, *torch.tensor(ends).cumsum(0).tolist()], dtype=torch.int32, device=device)
        offsets = [0, *torch.tensor(new_tokens).cumsum(0).tolist()]

        def keys_values(layer: int, k_TGD: torch.Tensor, v_TGD: torch.Tensor):
            keys, values = [], []
            for i, sequence in enumerate(sequences):
                k_buffer = self._keys[sequence][layer]
                v_buffer = self._values[sequence][layer]
                k_buffer[starts[i]:ends[i]] = k_TGD[offsets[i]:offsets[i + 1]]
                v_buffer[starts[i]:ends[i]] = v_TGD[offsets[i]:offsets[i + 1]]
                keys.append(k_buffer[:ends[i]])
                values.append(v_buffer[:ends[i]])
            return torch.cat(keys), torch.cat(values), cu_k

        def commit() -> None:
            for sequence, end in zip(sequences, ends):
                self._lengths[sequence] = end

        return keys_values, commit
