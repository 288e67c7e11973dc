"""Slots and pages out of range on the CPU path of mok.write_kv_cache and mok.paged_attention: a typed
mok.UnsupportedError naming the value, nothing written, never an IndexError or a result read from the
wrong place. (On CUDA the values are not read on the host; the ops' docstrings say what happens.)"""
from __future__ import annotations

import pytest
import torch

import mok
from tests.helpers.paged_cache import slot_mapping, to_pages

Z, G, Q, D = 4, 2, 4, 8
LENS = [5, 3]


def _setup():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(sum(LENS), G, D, generator=g)
    v = torch.randn(sum(LENS), G, D, generator=g)
    key_cache, value_cache, table = to_pages(k, v, LENS, Z)
    q = torch.randn(sum(LENS), Q, D, generator=g)
    cu = torch.tensor([0, 5, 8], dtype=torch.int32)
    seq_lens = torch.tensor(LENS, dtype=torch.int32)
    return k, v, key_cache, value_cache, table, q, cu, seq_lens


def _same_bits(a, b):
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_in_range_still_works():
    k, v, key_cache, value_cache, table, q, cu, seq_lens = _setup()
    out = mok.paged_attention(q, key_cache, value_cache, cu, seq_lens, table, 0.3)
    full = mok.attention(q, k, v, cu, cu, 0.3)
    assert torch.equal(out, full)
    loose_wide = torch.cat([table, torch.full((2, 2), -7, dtype=torch.int32)], 1)  # unused columns: any value
    loose_wide[1, 1] = 10_000  # sequence 1 needs one page only: its second column is never read
    assert torch.equal(mok.paged_attention(q, key_cache, value_cache, cu, seq_lens, loose_wide, 0.3), out)


@pytest.mark.parametrize("slot", ["past_end", "huge", "duplicate"])
def test_write_kv_cache_refuses_slots_out_of_range(slot):
    k, v, key_cache, value_cache, table, *_ = _setup()
    slots = slot_mapping(table, LENS, Z)
    num_slots = key_cache.shape[0] * Z
    bad = slots.clone()
    bad[-1] = {"past_end": num_slots, "huge": 1 << 40, "duplicate": int(slots[0])}[slot]
    before = key_cache.clone(), value_cache.clone()
    with pytest.raises(mok.UnsupportedError, match="slot"):
        mok.write_kv_cache(k, v, key_cache, value_cache, bad)
    _same_bits(key_cache, before[0])  # nothing written
    _same_bits(value_cache, before[1])


def test_write_kv_cache_negative_slots_are_padding():
    k, v, key_cache, value_cache, table, *_ = _setup()
    slots = slot_mapping(table, LENS, Z)
    slots[2] = -1
    before = key_cache.clone()
    mok.write_kv_cache(k, v, key_cache, value_cache, slots)
    page, row = divmod(int(slot_mapping(table, LENS, Z)[2]), Z)
    _same_bits(key_cache[page, row], before[page, row])  # token 2's slot: not written


@pytest.mark.parametrize("case", ["page_past_end", "page_negative", "keys_past_table", "keys_negative",
                                  "fewer_keys_than_queries", "cu_not_from_0", "cu_decreasing", "cu_not_T"])
def test_paged_attention_refuses_pages_and_lengths_out_of_range(case):
    _, _, key_cache, value_cache, table, q, cu, seq_lens = _setup()
    num_pages = key_cache.shape[0]
    if case == "page_past_end":
        table[0, 1] = num_pages
    elif case == "page_negative":
        table[1, 0] = -1
    elif case == "keys_past_table":
        seq_lens[0] = table.shape[1] * Z + 1
    elif case == "keys_negative":
        seq_lens[1] = -2
    elif case == "fewer_keys_than_queries":
        seq_lens[0] = 4
    elif case == "cu_not_from_0":
        cu = torch.tensor([1, 5, 8], dtype=torch.int32)
    elif case == "cu_decreasing":
        cu = torch.tensor([0, 9, 8], dtype=torch.int32)
    elif case == "cu_not_T":
        cu = torch.tensor([0, 5, 7], dtype=torch.int32)
    with pytest.raises(mok.UnsupportedError, match="paged attention"):
        mok.paged_attention(q, key_cache, value_cache, cu, seq_lens, table, 0.3)
