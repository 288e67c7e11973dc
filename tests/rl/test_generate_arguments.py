"""rl.generate's arguments: every value it cannot honour is an rl.InputError naming it, before any work;
no NaN temperature sampling token 0, no negative batch size giving empty completions."""
from __future__ import annotations

import pytest
import torch

import rl
from rl.testing import tiny_model


@pytest.fixture(scope="module")
def model():
    return rl.wrap(tiny_model("qwen3_moe", seed=0))


BAD = [
    ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", -1.0), ("temperature", "1"),
    ("temperature", None), ("temperature", True), ("temperature", torch.tensor(1.0)),
    ("batch_size", -1), ("batch_size", 0), ("batch_size", 1.5), ("batch_size", True), ("batch_size", "2"),
    ("max_new_tokens", 1.5), ("max_new_tokens", "2"), ("max_new_tokens", None), ("max_new_tokens", -1),
    ("max_new_tokens", True), ("max_new_tokens", float("nan")),
    ("top_k", 1.5), ("top_k", "2"), ("top_k", 0), ("top_k", True), ("top_k", -3),
    ("seed", 1.5), ("seed", "ab"), ("seed", ["a", "b"]), ("seed", [1]), ("seed", 2 ** 70), ("seed", [0, 2 ** 64]),
    ("seed", True), ("seed", None),
    ("eos_token_id", "a"), ("eos_token_id", 1.5), ("eos_token_id", True),
]


@pytest.mark.parametrize(("argument", "value"), BAD, ids=[f"{a}={v!r}" for a, v in BAD])
def test_bad_arguments_are_input_errors(model, argument, value):
    kwargs = {"max_new_tokens": 2, argument: value}
    with pytest.raises(rl.InputError, match=argument):
        rl.generate(model, [[5, 6], [7]], **kwargs)


def test_good_arguments_still_run(model):
    base = rl.generate(model, [[5, 6], [7]], max_new_tokens=2, seed=[3, 4])
    for kwargs in ({"batch_size": 1}, {"batch_size": 5}, {"temperature": 1}, {"top_k": 600},
                   {"eos_token_id": -1}, {"max_new_tokens": torch.tensor(2).item()}):
        out = rl.generate(model, [[5, 6], [7]], **{"max_new_tokens": 2, "seed": [3, 4], **kwargs})
        assert out.tokens == base.tokens
    greedy = rl.generate(model, [[5, 6]], max_new_tokens=3, temperature=0.0)
    assert len(greedy.tokens[0]) == 3
