"""mok.reference.elementwise: accurate to 1 fp32 ulp and independent of an element's position."""
import math

import pytest
import torch

from mok.reference import elementwise as ew

FUNCTIONS = {
    "exp": (ew.exp, torch.exp, (-100.0, 88.0)),
    "log": (ew.log, torch.log, (1e-30, 1e30)),
    "sigmoid": (ew.sigmoid, torch.sigmoid, (-60.0, 60.0)),
    "silu": (ew.silu, torch.nn.functional.silu, (-60.0, 60.0)),
    "sin": (ew.sin, torch.sin, (-50000.0, 50000.0)),
    "cos": (ew.cos, torch.cos, (-50000.0, 50000.0)),
}


def _samples(lo: float, hi: float, n: int = 20011) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if lo > 0:  # log-uniform for log
        return torch.exp(torch.empty(n, dtype=torch.float64).uniform_(math.log(lo), math.log(hi), generator=g)).float()
    return torch.empty(n, dtype=torch.float64).uniform_(lo, hi, generator=g).float()


def _ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    ia = a.view(torch.int32).long()
    ib = b.view(torch.int32).long()
    # map sign-magnitude to a monotone integer line
    ia = torch.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return (ia - ib).abs()


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_within_one_ulp_of_fp64(name):
    ours, theirs, (lo, hi) = FUNCTIONS[name]
    x = _samples(lo, hi)
    expected = theirs(x.double()).float()
    assert _ulp_distance(ours(x), expected).max().item() <= 1


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_bits_do_not_depend_on_position(name):
    ours, _, (lo, hi) = FUNCTIONS[name]
    x = _samples(lo, hi, 999)
    whole = ours(x)
    for start, length in [(0, 1), (5, 3), (17, 64), (500, 499), (998, 1)]:
        part = ours(x[start:start + length].clone())
        assert torch.equal(part.view(torch.int32), whole[start:start + length].view(torch.int32))
    alone = torch.stack([ours(x[i:i + 1])[0] for i in range(0, 999, 37)])
    assert torch.equal(alone.view(torch.int32), whole[::37].view(torch.int32))


def test_special_values():
    x = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1.0])
    assert torch.equal(ew.exp(x)[:4], torch.tensor([1.0, 1.0, math.inf, 0.0]))
    assert torch.isnan(ew.exp(x)[4])
    assert ew.exp(torch.tensor([1.0])).item() == torch.exp(torch.tensor([1.0], dtype=torch.float64)).float().item()
    lg = ew.log(torch.tensor([0.0, 1.0, -1.0, math.inf, math.nan]))
    assert lg[0].item() == -math.inf and lg[1].item() == 0.0 and math.isnan(lg[2].item())
    assert lg[3].item() == math.inf and math.isnan(lg[4].item())
    assert torch.isnan(ew.sin(torch.tensor([math.inf]))).all() and torch.isnan(ew.cos(torch.tensor([math.nan]))).all()
    assert ew.sigmoid(torch.tensor([-1000.0, 1000.0])).tolist() == [0.0, 1.0]
