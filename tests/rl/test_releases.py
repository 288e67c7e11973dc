"""rl.releases: the tested-release check shared by rl.trl and rl.verl (TRL's own case: tests/trl/test_logprobs.py)."""
import pytest
import torch

from mok.errors import UnsupportedError
from rl.releases import check_tested_release


def test_a_tested_major_minor_passes_and_returns_the_release():
    major_minor = ".".join(torch.__version__.split(".")[:2])
    assert check_tested_release("torch", "torch", ("0.1", major_minor), "rl.x") == torch.__version__


def test_another_release_is_refused_in_one_line_naming_owner_and_range(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "9.9.1")
    message = r"^rl\.x: torch 9\.9\.1 is not supported \(tested: 2\.11, 2\.13\.x\)$"
    with pytest.raises(UnsupportedError, match=message):
        check_tested_release("torch", "torch", ("2.11", "2.13"), "rl.x")
