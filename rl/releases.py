"""The framework releases an integration overriding internal API was written for (rl.trl: TRL; rl.verl: verl),
and the one check both run before touching the framework."""
from __future__ import annotations

import importlib

from mok.errors import UnsupportedError


def installed_release(package: str) -> str:
    """The installed package's `__version__` ('unknown' when it has none)."""
    return str(getattr(importlib.import_module(package), "__version__", "unknown"))


def check_tested_release(package: str, label: str, tested: tuple[str, ...], owner: str) -> str:
    """The installed release of `package`, or UnsupportedError when its major.minor is not in `tested`.

    >>> check_tested_release("torch", "torch", ("0.0",), "rl.example")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    mok.errors.UnsupportedError: rl.example: torch ... is not supported (tested: 0.0.x)
    """
    version = installed_release(package)
    if ".".join(version.split(".")[:2]) not in tested:
        raise UnsupportedError(f"{owner}: {label} {version} is not supported (tested: {', '.join(tested)}.x)")
    return version
