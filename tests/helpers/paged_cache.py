"""A paged KV cache built from packed keys, for the attention tests (shapes: docs/shapes.md)."""
from __future__ import annotations

import torch


def block_table(lens_k: list[int], page_size: int, seed: int = 0, device: str = "cpu"
                ) -> tuple[torch.Tensor, int]:
    """A block table int32 [B, pages per sequence] over shuffled pages (3 spare pages), and the page count."""
    pages_per_seq = max(-(-n // page_size) for n in lens_k)
    num_pages = len(lens_k) * pages_per_seq + 3
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).to(device)
    return order[: len(lens_k) * pages_per_seq].view(len(lens_k), pages_per_seq).to(torch.int32), num_pages


def slot_mapping(table_BP: torch.Tensor, lens_k: list[int], page_size: int) -> torch.Tensor:
    """The cache slot (page * Z + offset) of every packed key, int64 [S]."""
    return torch.cat([table_BP[b, torch.arange(n, device=table_BP.device) // page_size].long() * page_size
                      + torch.arange(n, device=table_BP.device) % page_size for b, n in enumerate(lens_k)])


def to_pages(k_SGD: torch.Tensor, v_SGD: torch.Tensor, lens_k: list[int], page_size: int, seed: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(key_cache [P, Z, G, D], value_cache [P, Z, G, W], block_table [B, pages]) holding the packed keys and
    values (v_SGD [S, G, W]) of each sequence in shuffled pages; every slot no key uses holds NaN (a kernel that
    read one would show it)."""
    table_BP, num_pages = block_table(lens_k, page_size, seed, str(k_SGD.device))
    key_cache = torch.full((num_pages * page_size, *k_SGD.shape[1:]), float("nan"), dtype=k_SGD.dtype,
                           device=k_SGD.device)
    value_cache = torch.full((num_pages * page_size, *v_SGD.shape[1:]), float("nan"), dtype=v_SGD.dtype,
                             device=v_SGD.device)
    slots_S = slot_mapping(table_BP, lens_k, page_size)
    key_cache[slots_S], value_cache[slots_S] = k_SGD[: slots_S.numel()], v_SGD[: slots_S.numel()]
    return key_cache.view(num_pages, page_size, *k_SGD.shape[1:]), \
        value_cache.view(num_pages, page_size, *v_SGD.shape[1:]), table_BP
