"""CPU reference of mok.log_softmax and mok.logprobs (fp32 over the vocabulary).

Shapes: docs/shapes.md. A row is walked in chunks of chunk_length(V) elements (a function of V only).
Semantics: m = max(x) (exact), e = exp(x - m) (position-independent fp32 exp), s = sum(e) in a fixed
two-level order (within each chunk in order, then over the chunks in order),
log_softmax = (x - m) - log(s). A row's bits depend only on that row.
"""
from __future__ import annotations

import torch

from mok.reference import elementwise
from mok.reference.reduce import sum_last


def chunk_length(vocab: int) -> int:
    """A power of two near sqrt(V), at least 64, so both loops stay short."""
    length = 64
    while length * length < vocab:
        length *= 2
    return length


def sum_rows_two_level(x_TV: torch.Tensor) -> torch.Tensor:
    """fp32 [T, V] -> [T]: sum each chunk in order, then the chunks in order (zero padding exact)."""
    num_rows, vocab = x_TV.shape
    length = chunk_length(vocab)
    num_chunks = -(-vocab // length)
    padded = torch.zeros(num_rows, num_chunks * length, dtype=torch.float32)  # [T, chunks * length]
    padded[:, :vocab] = x_TV
    by_offset = padded.view(num_rows, num_chunks, length).permute(2, 0, 1).contiguous()  # [length, T, chunks]
    acc = torch.zeros(num_rows, num_chunks, dtype=torch.float32)  # [T, chunks]
    for j in range(length):
        acc.add_(by_offset[j])
    return sum_last(acc)


def row_stats(logits_TV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x fp32 [T, V], max [T], log(sum(exp(x - max))) [T])."""
    x_TV = logits_TV.float()
    max_T = x_TV.amax(-1)
    sum_T = sum_rows_two_level(elementwise.exp(x_TV - max_T[:, None]))
    return x_TV, max_T, elementwise.log(sum_T)


def log_softmax(logits_TV: torch.Tensor) -> torch.Tensor:
    """[T, V] any float -> fp32 [T, V]."""
    x_TV, max_T, log_sum_T = row_stats(logits_TV)
    return (x_TV - max_T[:, None]) - log_sum_T[:, None]


def logprobs(logits_TV: torch.Tensor, token_ids_T: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[t, token_ids[t]] -> fp32 [T] (same bits as the full log_softmax entry)."""
    x_TV, max_T, log_sum_T = row_stats(logits_TV)
    picked_T = x_TV.gather(1, token_ids_T.long()[:, None])[:, 0]
    return (picked_T - max_T) - log_sum_T


def log_softmax_backward(grad_TV: torch.Tensor, log_softmax_TV: torch.Tensor) -> torch.Tensor:
    """d logits = g - softmax * sum(g), fp32 [T, V]."""
    grad_TV = grad_TV.float()
    return grad_TV - elementwise.exp(log_softmax_TV) * sum_rows_two_level(grad_TV)[:, None]
