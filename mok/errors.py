"""Typed errors raised by mok's public API."""


class MokError(Exception):
    """Base class of every error mok raises on purpose."""


class UnsupportedError(MokError, ValueError):
    """An input mok does not support: dtype, shape, device or configuration. The message names it."""
