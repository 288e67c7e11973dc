"""rl.logprobs' tensors: ids or a mask on the meta device (no data) or in a sparse layout are rl.InputError,
never torch's NotImplementedError."""
from __future__ import annotations

import pytest
import torch

import rl
from rl.testing import tiny_model


@pytest.fixture(scope="module")
def model():
    return rl.wrap(tiny_model("qwen3_moe", seed=0))


IDS = torch.randint(3, 512, (2, 5), generator=torch.Generator().manual_seed(0))
BAD = [
    ("ids on meta", lambda: (torch.empty(2, 5, dtype=torch.long, device="meta"), None), "input_ids.*meta"),
    ("mask on meta", lambda: (IDS, torch.empty(2, 5, dtype=torch.long, device="meta")), "attention_mask.*meta"),
    ("sparse ids", lambda: (IDS.to_sparse(), None), "input_ids.*dense"),
    ("sparse mask", lambda: (IDS, torch.ones(2, 5, dtype=torch.long).to_sparse()), "attention_mask.*dense"),
]


@pytest.mark.parametrize(("make", "message"), [(m, msg) for _, m, msg in BAD], ids=[n for n, _, _ in BAD])
def test_tensors_without_data_or_not_dense_are_input_errors(model, make, message):
    input_ids, attention_mask = make()
    with pytest.raises(rl.InputError, match=message):
        rl.logprobs(model, input_ids, attention_mask)


def test_dense_tensors_still_work(model):
    mask = torch.ones(2, 5, dtype=torch.long)
    assert torch.equal(rl.logprobs(model, IDS, mask), rl.logprobs(model, IDS))
