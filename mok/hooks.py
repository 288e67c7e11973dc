"""The one place where mok's ops can be observed.

mok knows nothing of `verify` or `rl`. Recorders attach here: `observe(recorder.record)`; ops call
`emit(name, tensor, kind)` only while someone observes, so the unobserved path costs one list check.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

Observer = Callable[[str, torch.Tensor, str], None]
"""observer(name, tensor, kind); kind is one of 'input', 'output', 'grad', 'param'."""

_observers: list[Observer] = []


class _Handle:
    def __init__(self, observer: Observer):
        self._observer = observer

    def remove(self) -> None:
        if self._observer in _observers:
            _observers.remove(self._observer)

    def __enter__(self) -> _Handle:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def observe(observer: Observer) -> _Handle:
    """Call `observer(name, tensor, kind)` for every tensor mok's ops emit, until the handle is removed."""
    _observers.append(observer)
    return _Handle(observer)


def observed() -> bool:
    return len(_observers) != 0  # (dynamo in torch 2.11 cannot trace bool() of a list)


def emit(name: str, tensor: torch.Tensor, kind: str) -> None:
    for observer in tuple(_observers):
        observer(name, tensor, kind)
