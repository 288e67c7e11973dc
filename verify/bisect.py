"""Bisection of a git history to the first revision whose output diverges from the good revision's.

The command runs in a throwaway `git worktree` (the user's checkout is never touched), cleaned with
`git clean -fdx` before each revision. It writes its output (a verify trace or a checkpoint /
manifest) to the path given by `{output}` in the command, or by the environment variable
MOK_VERIFY_OUTPUT, or to `output` (a path relative to the worktree) when that is given. Each output
is compared with the good revision's: a trace with `diff_traces`, anything else with
`compare_checkpoints`. Exit code 125 from the command skips a revision (as with `git bisect run`).
Like git bisect, this assumes that once the output diverges it stays diverged.

`timeout` (seconds) bounds each run of the command: a run that exceeds it is killed (its whole
process group: the command runs in a session of its own) and the revision counts as skipped, said so
in the log, in `BisectResult.timed_out` and in the description. SIGTERM is handled like Ctrl-C: the
running command's process group is killed, the worktree unregistered from the user's repository and
the temporary directory removed; then the signal's previous disposition applies (by default the
process dies of SIGTERM).
"""
from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from verify.args import as_path, as_seconds, what_is_at
from verify.errors import BisectError, InputNotFoundError

SKIP_EXIT_CODE = 125
_SQLITE_MAGIC = b"SQLite format 3\0"


@dataclass
class BisectResult:
    """first_bad: the first revision (full hash) whose output differs from good's, or None when even
    bad's output equals good's. divergence: how that output differs (text and JSON). tested: each
    revision run, with 'good', 'bad' or 'skip'."""

    good: str
    bad: str
    first_bad: str | None
    subject: str | None = None
    divergence: str | None = None
    divergence_json: dict | None = None
    tested: list[tuple[str, str]] = field(default_factory=list)
    candidates: int = 0
    timeout: float | None = None
    timed_out: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"good": self.good, "bad": self.bad, "first_bad": self.first_bad, "subject": self.subject,
                "divergence": self.divergence_json, "tested": [list(t) for t in self.tested],
                "candidates": self.candidates, "timeout": self.timeout, "timed_out": self.timed_out}

    def describe(self) -> str:
        if self.first_bad is None:
            text = f"no divergence: the output of {self.bad[:12]} equals that of {self.good[:12]}"
        else:
            text = f"first diverging revision: {self.first_bad} {self.subject}\n{self.divergence}"
        if self.timed_out:
            text += (f"\ntimed out after {self.timeout:g} s, counted as skipped: "
                     f"{', '.join(r[:12] for r in self.timed_out)}")
        return text


def _git(repo: Path, *args: str) -> str:
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, encoding="utf-8", errors="replace")
    if proc.returncode != 0:
        message = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        raise BisectError(f"git {' '.join(args)} failed in {repo}: {message}")
    return proc.stdout.strip()


def _resolve(top: Path, rev: str) -> str:
    try:
        return _git(top, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except BisectError:
        raise BisectError(f"unknown revision {rev!r} in {top}") from None


def _is_trace(path: Path) -> bool:
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(len(_SQLITE_MAGIC)) == _SQLITE_MAGIC


def compare_outputs(good: Path, other: Path) -> tuple[bool, str, dict]:
    """(identical, description, json) of two command outputs: traces or checkpoints."""
    if _is_trace(good) and _is_trace(other):
        from verify.compare import diff_traces

        result = diff_traces(good, other)
    else:
        from verify.checkpoint import compare_checkpoints

        result = compare_checkpoints(good, other, progress=False)
    return result.identical, result.describe(), result.to_json()


class _Terminated(BaseException):
    """Raised in the main thread by the SIGTERM handler, so that every cleanup runs (as on Ctrl-C)."""


@contextlib.contextmanager
def _sigterm_unwinds():
    """While inside: SIGTERM raises _Terminated (main thread only; elsewhere nothing changes). On the way
    out after a SIGTERM, the previous handler is restored and the signal re-delivered to this process."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise _Terminated()

    if signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:  # the caller ignores SIGTERM: leave it so
        yield
        return
    previous = signal.signal(signal.SIGTERM, handler)
    terminated = False
    try:
        yield
    except _Terminated:
        terminated = True
    finally:
        signal.signal(signal.SIGTERM, previous)
    if terminated:
        signal.raise_signal(signal.SIGTERM)  # the previous disposition now applies (default: die)
        raise BisectError("bisect stopped by SIGTERM (the command was killed, the worktree removed)")


def bisect(repo: str | os.PathLike, good: str, bad: str, cmd: str, output: str | None = None,
           log: Callable[[str], None] | None = None, timeout: float | None = None) -> BisectResult:
    """Find the first revision in good..bad whose command output diverges from good's.

    repo: a git repository; good, bad: revisions (good an ancestor of bad); cmd: a shell command run
    in the worktree root; output: where cmd writes its output, relative to the worktree (optional,
    see the module docstring). log: called with one line per tested revision (default: stderr).
    timeout: seconds per run of cmd (a positive finite number); a run past it is killed and its revision
    skipped (None: no limit). The command's output may hold any bytes (decoded as UTF-8, errors replaced).
    Raises BisectError (arguments of the wrong type, a failing git or command, ...), InputNotFoundError.
    """
    repo = as_path(repo, "repo", BisectError)
    for label, value in (("good", good), ("bad", bad), ("cmd", cmd)):
        if not isinstance(value, str) or not value.strip():
            raise BisectError(f"{label} must be a non-empty str, got {value!r}")
    if output is not None and (not isinstance(output, str) or not output.strip()):
        raise BisectError(f"output must be a path relative to the worktree (a non-empty str) or None, got {output!r}")
    if log is not None and not callable(log):
        raise BisectError(f"log must be a callable taking one line, or None, got {log!r}")
    timeout = as_seconds(timeout, "timeout", BisectError)
    with _sigterm_unwinds():
        return _bisect(repo, good, bad, cmd, output, log, timeout)


def _bisect(repo, good, bad, cmd, output, log, timeout) -> BisectResult:
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    repo = Path(repo)
    there = what_is_at(repo)
    if there is None:
        raise InputNotFoundError(f"repository not found: {repo}")
    if there != "a directory":
        raise BisectError(f"{repo} is {there}, not a git repository")
    top = Path(_git(repo, "rev-parse", "--show-toplevel"))
    good_rev, bad_rev = _resolve(top, good), _resolve(top, bad)
    if good_rev == bad_rev:
        raise BisectError(f"good and bad are the same revision ({good_rev[:12]})")
    if subprocess.run(["git", "-C", str(top), "merge-base", "--is-ancestor", good_rev, bad_rev]).returncode != 0:
        raise BisectError(f"good revision {good} is not an ancestor of bad revision {bad}")
    revs = _git(top, "rev-list", "--reverse", "--topo-order", "--ancestry-path", f"{good_rev}..{bad_rev}").split()
    result = BisectResult(good_rev, bad_rev, None, candidates=len(revs), timeout=timeout)

    with tempfile.TemporaryDirectory(prefix="mok-verify-bisect-") as tmp:
        tmp = Path(tmp)
        worktree = tmp / "worktree"
        try:
            _git(top, "worktree", "add", "--detach", "--force", str(worktree), good_rev)
            runner = _Runner(top, worktree, tmp, cmd, output, log, timeout)
            good_out = runner.run(good_rev)
            if good_out is None:
                raise BisectError(f"the command {runner.skip_reason(good_rev)} at the good revision {good_rev[:12]}")
            result.tested.append((good_rev, "good"))

            outcomes: dict[int, str] = {}

            def test(index: int) -> str:
                out = runner.run(revs[index])
                note = ""
                if out is None:
                    status = "skip"
                    if revs[index] in runner.timed_out:
                        result.timed_out.append(revs[index])
                        note = f" (timed out after {timeout:g} s)"
                else:
                    status = "good" if compare_outputs(good_out, out)[0] else "bad"
                outcomes[index] = status
                result.tested.append((revs[index], status))
                log(f"[bisect] {revs[index][:12]} {status}{note}")
                return status

            hi = len(revs) - 1
            if test(hi) != "bad":
                if outcomes[hi] == "skip":
                    raise BisectError(f"the command {runner.skip_reason(bad_rev)} at the bad revision "
                                      f"{bad_rev[:12]}")
                return result
            lo = -1
            while True:
                untested = [i for i in range(lo + 1, hi) if i not in outcomes]
                if not untested:
                    break
                mid = min(untested, key=lambda i: (abs(i - (lo + hi) / 2), i))
                status = test(mid)
                if status == "good":
                    lo = mid
                elif status == "bad":
                    hi = mid
            result.first_bad = revs[hi]
            result.subject = _git(top, "log", "-1", "--format=%s", revs[hi])
            skipped_before = [revs[i][:12] for i in range(lo + 1, hi) if outcomes.get(i) == "skip"]
            identical, text, doc = compare_outputs(good_out, runner.outputs[revs[hi]])
            if skipped_before:
                text += ("\n(skipped revisions just before it, any of which may be the first: "
                         f"{', '.join(skipped_before)})")
            result.divergence, result.divergence_json = text, doc
            return result
        finally:
            # Also after SIGTERM / Ctrl-C: a further signal must not cut the cleanup short.
            with _signals_deferred():
                subprocess.run(["git", "-C", str(top), "worktree", "remove", "--force", str(worktree)],
                               capture_output=True)
                subprocess.run(["git", "-C", str(top), "worktree", "prune"], capture_output=True)


@contextlib.contextmanager
def _signals_deferred():
    """Hold SIGINT and SIGTERM while inside (main thread only); one that arrived is re-raised on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    saved = {sig: signal.signal(sig, lambda signum, frame: arrived.append(signum))
             for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(arrived):
            signal.raise_signal(sig)


class _Runner:
    """Checks out revisions in the worktree, runs the command, keeps each output under tmp/outputs."""

    def __init__(self, top: Path, worktree: Path, tmp: Path, cmd: str, output: str | None, log,
                 timeout: float | None = None):
        self.top, self.worktree, self.tmp, self.cmd, self.output, self.log = top, worktree, tmp, cmd, output, log
        self.timeout = timeout
        self.outputs: dict[str, Path] = {}
        self.timed_out: set[str] = set()

    def skip_reason(self, rev: str) -> str:
        if rev in self.timed_out:
            return f"timed out (after {self.timeout:g} s)"
        return f"asked to skip (exit {SKIP_EXIT_CODE})"

    def _execute(self, command: str, env: dict) -> subprocess.CompletedProcess | None:
        """Run the command in a session (process group) of its own; None when it timed out. Whatever
        happens (timeout, Ctrl-C, SIGTERM), the whole group is killed before this returns."""
        proc = subprocess.Popen(command, shell=True, cwd=self.worktree, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, encoding="utf-8", errors="replace",  # any bytes
                                start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=self.timeout)
            return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)
        except subprocess.TimeoutExpired:
            return None
        finally:
            with _signals_deferred():
                _kill_group(proc)

    def run(self, rev: str) -> Path | None:
        _git(self.worktree, "checkout", "--detach", "--force", "--quiet", rev)
        _git(self.worktree, "clean", "-fdxq")
        out_dir = self.tmp / "outputs" / rev
        out_dir.mkdir(parents=True)
        target = out_dir / "output"
        produced = (self.worktree / self.output) if self.output else target
        command = self.cmd.replace("{output}", shlex.quote(str(produced)))
        env = {**os.environ, "MOK_VERIFY_OUTPUT": str(produced), "MOK_VERIFY_REVISION": rev}
        proc = self._execute(command, env)
        if proc is None:
            self.timed_out.add(rev)
            return None
        if proc.returncode == SKIP_EXIT_CODE:
            return None
        if proc.returncode != 0:
            tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or [""]
            raise BisectError(f"command failed at {rev[:12]} (exit code {proc.returncode}): {tail[0]}")
        if not produced.exists():
            raise BisectError(f"command wrote no output at {rev[:12]} (expected {produced})")
        if produced != target:
            (shutil.copytree if produced.is_dir() else shutil.copy2)(produced, target)
            for suffix in ("-wal", "-shm"):  # a trace whose writer did not close cleanly
                if Path(f"{produced}{suffix}").exists():
                    shutil.copy2(f"{produced}{suffix}", f"{target}{suffix}")
        self.outputs[rev] = target
        return target


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group the command leads (its children too, even after it exited), and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()
    proc.wait()
