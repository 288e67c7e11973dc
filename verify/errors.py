"""Typed errors raised by verify's public API.

Every user error (missing or corrupt file, wrong schema, unsupported dtype, failing bisect command)
is a `VerifyError`; the command line turns one into a single line on stderr and exit code 2.
"""
from __future__ import annotations


class VerifyError(Exception):
    """Base class of every error verify raises on purpose. The message is one self-contained line."""


class InputNotFoundError(VerifyError, FileNotFoundError):
    """A path given by the user does not exist."""


class UnsupportedDtypeError(VerifyError, TypeError):
    """A tensor dtype that fingerprints do not cover (complex, quantized, ...)."""


class TraceError(VerifyError):
    """A file is not a readable verify trace (not SQLite, not written by verify, corrupt)."""


class SchemaVersionError(TraceError):
    """A verify trace written with a schema version this verify does not read."""


class CheckpointError(VerifyError):
    """A checkpoint that cannot be read: truncated or corrupt safetensors, unknown layout, not a state dict."""


class ManifestError(CheckpointError):
    """A manifest that is not JSON or not a verify manifest."""


class BisectError(VerifyError):
    """Bisection cannot proceed: not a git repository, unknown revision, the command failed."""


class RecorderError(VerifyError):
    """The Recorder was misused (recording after close, an unknown kind or phase)."""
