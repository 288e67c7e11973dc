"""Sparse (COO, CSR) and nested tensors given to any mok op: a typed mok.UnsupportedError naming the layout,
never a raw RuntimeError / NotImplementedError from deep inside."""
from __future__ import annotations

import pytest
import torch

import mok

T, H, I, E = 4, 8, 6, 4


def _inputs():
    g = torch.Generator().manual_seed(0)
    return {
        "x": torch.randn(T, H, generator=g), "w": torch.ones(H), "lin": torch.randn(3, H, generator=g),
        "logits": torch.randn(T, E, generator=g), "w13": torch.randn(E, 2 * I, H, generator=g) * 0.1,
        "w2": torch.randn(E, H, I, generator=g) * 0.1, "q": torch.randn(T, 4, 8, generator=g),
        "k": torch.randn(T, 2, 8, generator=g), "cu": torch.tensor([0, T], dtype=torch.int32),
        "ids": torch.zeros(T, 2, dtype=torch.long), "tokens": torch.zeros(T, dtype=torch.long),
        "cache": torch.zeros(3, 4, 2, 8), "slots": torch.arange(T), "table": torch.tensor([[0, 1]], dtype=torch.int32),
        "lens": torch.tensor([T], dtype=torch.int32),
    }


CALLS = {
    "rms_norm": (lambda a: mok.rms_norm(a["x"], a["w"], 1e-6), ["x", "w"]),
    "linear": (lambda a: mok.linear(a["x"], a["lin"]), ["x", "lin"]),
    "silu_and_mul": (lambda a: mok.silu_and_mul(a["x"]), ["x"]),
    "route": (lambda a: mok.route(a["logits"], 2), ["logits"]),
    "moe": (lambda a: mok.moe(a["x"], a["logits"], a["w13"], a["w2"], 2), ["x", "logits", "w13", "w2"]),
    "moe replay": (lambda a: mok.moe(a["x"], a["logits"], a["w13"], a["w2"], 2, topk_ids=a["ids"]), ["ids"]),
    "attention": (lambda a: mok.attention(a["q"], a["k"], a["k"], a["cu"], a["cu"], 0.3), ["q", "k", "cu"]),
    "paged_attention": (lambda a: mok.paged_attention(a["q"], a["cache"], a["cache"], a["cu"], a["lens"], a["table"],
                                                      0.3), ["q", "cache", "cu", "lens", "table"]),
    "write_kv_cache": (lambda a: mok.write_kv_cache(a["k"], a["k"], a["cache"], a["cache"].clone(), a["slots"]),
                       ["k", "cache", "slots"]),
    "log_softmax": (lambda a: mok.log_softmax(a["x"]), ["x"]),
    "logprobs": (lambda a: mok.logprobs(a["x"], a["tokens"]), ["x", "tokens"]),
    "rotary": (lambda a: mok.rotary(a["q"], a["tokens"], 10000.0), ["q", "tokens"]),
}
CASES = [(op, name, layout) for op, (_, names) in CALLS.items() for name in names for layout in ("coo", "csr")
         if not (layout == "csr" and name in ("w", "cu", "lens", "slots", "tokens", "w13", "w2", "q", "k", "cache"))]


def _convert(t, layout):
    return t.to_sparse() if layout == "coo" else t.to_sparse_csr()


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize(("op", "name", "layout"), CASES, ids=[f"{o}-{n}-{lay}" for o, n, lay in CASES])
def test_sparse_inputs_are_unsupported_errors(op, name, layout):
    call, _ = CALLS[op]
    inputs = _inputs()
    call(inputs)  # dense: runs
    inputs[name] = _convert(inputs[name], layout)
    with pytest.raises(mok.UnsupportedError, match="dense"):
        call(inputs)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_inputs_are_unsupported_errors():
    x = torch.nested.nested_tensor([torch.randn(2, H), torch.randn(3, H)])
    with pytest.raises(mok.UnsupportedError, match="dense"):
        mok.rms_norm(x, torch.ones(H), 1e-6)
    with pytest.raises(mok.UnsupportedError, match="dense"):
        mok.linear(x, torch.randn(3, H))
