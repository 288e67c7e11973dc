"""Argument and file checks shared by verify's public functions: each raises a typed VerifyError naming the argument
(`ArgumentError` unless the caller passes its own class), never Python's TypeError from deep inside."""
from __future__ import annotations

import errno
import math
import numbers
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from verify.errors import ArgumentError, VerifyError


def as_path(value, label: str, error: type[VerifyError] = ArgumentError) -> Path:
    """A str or os.PathLike (not bytes, not empty) as a Path."""
    if isinstance(value, (str, os.PathLike)) and not isinstance(value, bytes):
        path = Path(value)
        if str(value) != "":
            return path
    raise error(f"{label} must be a path (str or os.PathLike), got {value!r}")


def as_globs(value, label: str) -> list[str] | None:
    """None, one glob (str) or a sequence of globs -> a list of str (or None)."""
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if isinstance(value, Sequence) and all(isinstance(item, str) for item in value):
        return list(value)
    raise ArgumentError(f"{label} must be a glob or a list of globs (str), got {value!r}")


def as_int(value, label: str, error: type[VerifyError] = ArgumentError) -> int:
    """An integer (not a bool, not a float)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise error(f"{label} must be an int, got {value!r}")
    return int(value)


def as_steps(value, label: str = "steps") -> list[int] | None:
    """None, or an iterable of ints -> a list of int."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ArgumentError(f"{label} must be a list of step numbers (ints) or None, got {value!r}")
    return [as_int(step, f"{label}: step") for step in value]


def as_flag(value, label: str, error: type[VerifyError] = ArgumentError, optional: bool = False) -> bool | None:
    """A bool (or None when optional)."""
    if optional and value is None:
        return None
    if not isinstance(value, bool):
        raise error(f"{label} must be {'True, False or None' if optional else 'True or False'}, got {value!r}")
    return value


def as_seconds(value, label: str, error: type[VerifyError] = ArgumentError) -> float | None:
    """None, or a finite number of seconds > 0."""
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or not value > 0):
        raise error(f"{label} must be a positive, finite number of seconds, got {value!r}")
    return float(value)


def special_file(path: Path) -> str | None:
    """'a FIFO', 'a device', 'a socket' for a special file (reading it could block or never end), else None."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return None


def what_is_at(path: Path) -> str | None:
    """What a file system entry is, for an error message: None when nothing is there (a dangling symlink
    included), "a regular file", "a directory", "a symlink loop", one of `special_file`'s kinds, or
    "not accessible (...)" when it cannot be looked at."""
    try:
        mode = path.stat().st_mode
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return None
        if e.errno == errno.ELOOP:
            return "a symlink loop"
        return f"not accessible ({e.strerror or e})"
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISDIR(mode):
        return "a directory"
    return special_file(path) or "not a regular file"


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one existing file (any spelling, a symlink or a hard link)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def write_atomically(output: Path, data: str | bytes) -> None:
    """Write `data` to `output` (through a symlink: to its target) via a temporary file and a rename, so an
    interrupted write never leaves a truncated file. VerifyError when it cannot be written."""
    import tempfile

    target = output.resolve()
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    except OSError as e:
        raise VerifyError(f"cannot write {output}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, target.stat().st_mode & 0o7777 if target.is_file() else 0o666 & ~umask)
        os.replace(tmp, target)
    except OSError as e:
        raise VerifyError(f"cannot write {output}: {e.strerror or e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
