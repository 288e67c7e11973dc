"""Typed errors raised by verify's public API.

Every user error (an argument of the wrong type or range, a missing, special or corrupt file, a wrong
schema, an unsupported dtype or layout, a failing bisect command) is a `VerifyError`; the command line
turns one into a single line on stderr and exit code 2. Each public function documents which subclass.
"""
from __future__ import annotations


class VerifyError(Exception):
    """Base class of every error verify raises on purpose. The message is one self-contained line."""


class ArgumentError(VerifyError, ValueError):
    """An argument of the wrong type or outside its range (a path that is not a path, names that are not
    strings, a step that is not an int, ...). The message names the argument."""


class InputNotFoundError(VerifyError, FileNotFoundError):
    """A path given by the user does not exist."""


class UnsupportedDtypeError(VerifyError, TypeError):
    """A tensor that fingerprints do not cover: its dtype (complex, quantized, ...), its layout (sparse,
    nested) or its device (meta: no contents)."""


class TraceError(VerifyError):
    """A file is not a readable verify trace (not SQLite, not written by verify, corrupt)."""


class SchemaVersionError(TraceError):
    """A verify trace written with a schema version this verify does not read."""


class CheckpointError(VerifyError):
    """A checkpoint that cannot be read: truncated or corrupt safetensors, unknown layout, not a state dict,
    a special file (FIFO, device), an index whose weight map is malformed."""


class ManifestError(CheckpointError):
    """A manifest that is not JSON or not a verify manifest."""


class BisectError(VerifyError):
    """Bisection cannot proceed: not a git repository, unknown revision, the command failed, an argument
    of the wrong type, a timeout that is not a positive finite number of seconds."""


class RecorderError(VerifyError):
    """The Recorder was misused (a path that cannot be a trace, recording after close, an unknown kind or
    phase, a name that is not a string, a module selection that selects nothing or is malformed)."""
