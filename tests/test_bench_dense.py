"""bench/dense.py on the CPU (tiny shape): every case's torch counterpart computes what the mok op computes,
and a dry run of the whole script writes the summary (bench/results/dense-latest.json's layout)."""
from __future__ import annotations

import json

import pytest
import torch

from bench import dense


@pytest.mark.parametrize("op", dense.OPS)
def test_torch_counterpart_matches_mok(op):
    (case,) = dense.cases(dense.SHAPES["tiny"], 7, torch.device("cpu"), ops=[op])
    assert case.op == op and case.rows == 7
    got, want = dense._outputs(case.mok(**case.inputs)), dense._outputs(case.torch_fn(**case.inputs))
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g.double(), w.double(), atol=6e-2, rtol=3e-2)


def test_rotary_counterpart_is_transformers_qwen3():
    modeling = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    q, k = torch.randn(5, 4, 16).bfloat16(), torch.randn(5, 2, 16).bfloat16()
    positions = torch.tensor([0, 3, 1, 7, 2])
    cos, sin = dense.rope_tables(1e4, 16, 8, "cpu", torch.bfloat16)
    want = modeling.apply_rotary_pos_emb(q, k, cos[positions], sin[positions], unsqueeze_dim=1)
    got = dense.torch_rotary(q, k, positions, cos, sin)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_dry_run_writes_the_summary(tmp_path):
    out, summary_path = tmp_path / "rows.jsonl", tmp_path / "dense.json"
    dense.main(["--device", "cpu", "--shape", "tiny", "--tokens", "1", "3", "--logits-rows", "2",
                "--out", str(out), "--json", str(summary_path)])
    summary = json.loads(summary_path.read_text())
    assert summary["meta"]["device"] == "cpu" and "torch_ms / mok_ms" in summary["meta"]["speedup"]
    assert set(summary) == {"meta", *dense.OPS}
    keys = {"rows", "mok_fwd_ms", "torch_fwd_ms", "fwd_speedup_vs_torch", "mok_fwdbwd_ms", "torch_fwdbwd_ms",
            "fwdbwd_speedup_vs_torch"}
    for op in dense.OPS:
        assert set(summary[op]) == {"1", "3"}
        for tokens, entry in summary[op].items():
            assert set(entry) == keys, (op, entry)
            vocab_sized = op in ("lm_head", "log_softmax", "logprobs")
            assert entry["rows"] == (min(int(tokens), 2) if vocab_sized else int(tokens))
            assert all(isinstance(entry[key], int | float) and entry[key] >= 0 for key in keys)
    assert len(out.read_text().splitlines()) == 1 + 2 * len(dense.OPS)
