"""bench/attention_sweep.py's candidate tables and FLOP counts (the sweep itself runs on a GPU)."""
from __future__ import annotations

import pytest

from bench import attention_sweep as sweep
from mok.kernels import attention


@pytest.mark.parametrize("heads", sorted(sweep.HEADS))
def test_the_first_candidate_of_every_kernel_is_todays_config(heads):
    layout = sweep.HEADS[heads]
    suffix = "_wide" if layout.wide else ""
    assert layout.wide == (layout.head_dim > attention.WIDE_HEAD)
    for kernel, configs in sweep.candidates(layout).items():
        if kernel == "forward_key_block":
            continue
        assert configs[0] == attention.CONFIGS[kernel + suffix], kernel
        assert len({str(sorted(c.items())) for c in configs}) == len(configs), f"{kernel}: a candidate twice"


@pytest.mark.parametrize("kernel", ["forward", "backward_dq"])
def test_mla_candidates_pack_whole_groups_of_heads(kernel):
    """PACK query heads of one token share a tile: a power of two dividing the heads per key head, <= BLOCK_M."""
    layout = sweep.HEADS["mla"]
    group = layout.q_heads // layout.kv_heads
    for config in sweep.candidates(layout)[kernel]:
        pack = config.get("PACK", 1)
        assert pack & (pack - 1) == 0 and group % pack == 0 and pack <= config["BLOCK_M"], config


def test_causal_flops_count_both_widths():
    qwen3, mla = sweep.HEADS["qwen3"], sweep.HEADS["mla"]
    # equal widths: forward 2 dots, backward 5, of D features per (query, key) pair and head
    assert sweep.causal_flops([100], qwen3, 1, 1) == 2 * 100 * 100 * 32 * 128
    assert sweep.causal_flops([100, 50], qwen3, 3, 2) == 5 * (100 * 100 + 50 * 50) * 32 * 128
    assert sweep.causal_flops([10], mla, 1, 1) == 10 * 10 * 128 * (576 + 512)


def test_decode_candidates_regroup_rows_only_and_are_each_timed_once():
    """A decode candidate may change BLOCK_M, PACK, warps and stages (none of which moves a row's bits), nothing
    else; today's tile for Qwen3's heads is timed first by sweep_decode and is not a candidate again."""
    today = attention._forward_config(128, 8, True)
    assert today not in sweep.DECODE_CANDIDATES
    assert len({str(sorted(c.items())) for c in sweep.DECODE_CANDIDATES}) == len(sweep.DECODE_CANDIDATES)
    for config in sweep.DECODE_CANDIDATES:
        pack = config["PACK"]
        assert set(config) == set(today), config
        assert pack & (pack - 1) == 0 and 16 <= config["BLOCK_M"] and pack <= config["BLOCK_M"], config
