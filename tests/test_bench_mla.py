"""bench/mla.py on the CPU (tiny shape): the two attention blocks it times compute the same layer (mok's absorbed
MLA and transformers' DeepseekV3Attention with SDPA, same weights), and a dry run writes the summary
(bench/results/mla-latest.json's layout)."""
from __future__ import annotations

import json

import torch

from bench import mla


def test_mok_block_computes_transformers_attention():
    from rl.models import mla as mla_model
    from rl.models.decoder import no_cache

    ours, theirs, rotary_emb = mla.attention_layer("tiny", torch.device("cpu"))
    x_BLH = torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    positions_BL = torch.arange(40).repeat(2, 1)
    cu = torch.tensor([0, 40, 80], dtype=torch.int32)
    with torch.no_grad():
        got = mla_model.forward(ours, x_BLH.view(-1, 64), positions_BL.view(-1), cu, no_cache(cu), 0)
        want = theirs(x_BLH, rotary_emb(x_BLH, positions_BL), None)[0].view(-1, 64)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_dry_run_writes_the_summary(tmp_path):
    path = tmp_path / "mla.json"
    mla.main(["--device", "cpu", "--shapes", "tiny", "--seq-lens", "16", "--total-tokens", "32", "--decode", "2x70",
              "--json", str(path)])
    summary = json.loads(path.read_text())
    assert set(summary) == {"meta", "block", "decode"} and summary["meta"]["device"] == "cpu"
    (block,) = summary["block"]
    assert block["batch"] == 2 and block["fwd_ratio"] > 0 and block["fwd_bwd_ratio"] > 0
    assert block["max_abs_diff_vs_transformers"] < 2e-2
    (decode,) = summary["decode"]
    assert decode["kv_bytes"] == 2 * 70 * (32 + 8) * 2
