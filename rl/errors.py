"""The errors `rl` raises on purpose; all are `mok.MokError` (and `UnsupportedError`, a ValueError, where
the input is at fault), so `except mok.MokError` catches every one of them.

- `UnsupportedModelError`: the model (architecture, a config field's value, module layout, or
  parameters not materialised, e.g. on the meta device) is not one `rl` can compute through mok.
- `InputError`: the tensors or arguments given to `rl.logprobs`, the wrapped forward or `rl.generate`
  (token ids outside the vocabulary, a mask with gaps, wrong shapes or dtypes, refused keyword arguments).
- `ContractMismatchError`: `rl.check_contract` found that the trainer and the sampler do not run the
  same execution contract; `.differences` maps each differing key to (trainer value, sampler value).
"""
from __future__ import annotations

from mok.errors import MokError, UnsupportedError


class UnsupportedModelError(UnsupportedError):
    """The model (architecture, configuration or module layout) is not one `rl` can route through mok."""


class InputError(UnsupportedError):
    """An input of rl.logprobs / the wrapped forward / rl.generate that rl refuses; the message names it."""


class ContractMismatchError(MokError):
    """The trainer's and the sampler's execution contracts differ; `differences`: key -> (trainer, sampler)."""

    def __init__(self, message: str, differences: dict[str, tuple[object, object]]):
        super().__init__(message)
        self.differences = differences


__all__ = ["UnsupportedModelError", "InputError", "ContractMismatchError"]
