"""The writer process of `verify.Recorder(background=True)`.

A recorder that writes in the background hands each step to a child process as raw host arrays: the eager records'
row digests and each capture tap's ring words (verify/capture.py, `RingWords`). The child builds the records from
them (verify/step_records.py, `commit_step`) and commits them to the trace, which only it has open. So the recording
process spends no interpreter time on records or SQLite: a sampler's decode loop, whose steps are a few milliseconds
of Python, would otherwise wait for its interpreter lock while a writer thread builds hundreds of records.

Protocol: pickles over two pipes, one reply per request, in order: ("open", TraceWriter's arguments) ->
("ok", None); ("step", StepData) -> ("ok", None); ("close", None) -> ("ok", None), then the child exits. A failed
request replies ("error", one line), which the parent raises as RecorderError. The child ignores SIGINT (a Ctrl-C
reaches the parent, whose close still needs the child); when the parent is gone (end of file on the requests) it
exits at once and leaves the trace as a killed writer leaves it: every step it committed is kept, the trace is not
marked closed (verify/store.py).
"""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

from verify.errors import RecorderError
from verify.trace_writer import _WriterLock, checked_arguments, real_path

_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


class WriterProcess:
    """A TraceWriter in a child process: the same arguments and checks (RecorderError, raised here), the per-process
    claim on the trace held here and the file lock in the child. `commit(data)` sends a step and waits for the
    child's reply (the Recorder calls it from its own thread, which then waits on a pipe, not on the interpreter).
    Starting one costs an interpreter start that imports torch (about 2 s on a 2-core machine)."""

    def __init__(self, path: str | os.PathLike, run: str, meta: dict | None = None, overwrite: bool = False,
                 sampling: dict | None = None):
        self.path, run, meta, overwrite = checked_arguments(path, run, meta, overwrite)
        self.real_path = real_path(self.path)
        self._claim = _WriterLock(self.path, self.real_path, across_processes=False)
        self._proc = None
        self._lost: str | None = None  # why the child is gone, when it went before close()
        try:
            self._start()
            self._call("open", {"path": self.path, "run": run, "meta": meta, "overwrite": overwrite,
                                "sampling": sampling})
        except BaseException:
            self._stop()
            raise

    def _start(self) -> None:
        requests_read, requests_write = os.pipe()
        replies_read, replies_write = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        try:
            # a session of its own: a Ctrl-C meant for the recording process does not reach it (its close needs
            # the child), while the child still ends at end of file when the recording process is gone
            self._proc = subprocess.Popen(
                [sys.executable, "-c", "from verify.writer_process import main; main()",
                 str(requests_read), str(replies_write)],
                pass_fds=(requests_read, replies_write), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                env=env, start_new_session=True)
        except BaseException as e:
            for fd in (requests_read, requests_write, replies_read, replies_write):
                os.close(fd)
            if isinstance(e, OSError):
                raise RecorderError(f"cannot start the writer process of trace {self.path}: {e}") from None
            raise
        os.close(requests_read)
        os.close(replies_write)
        self._requests = os.fdopen(requests_write, "wb")
        self._replies = os.fdopen(replies_read, "rb")

    def _call(self, kind: str, payload) -> None:
        if self._proc is None:
            raise RecorderError(self._lost or f"the writer process of trace {self.path} is closed")
        try:
            pickle.dump((kind, payload), self._requests, protocol=pickle.HIGHEST_PROTOCOL)
            self._requests.flush()
            status, message = pickle.load(self._replies)
        except (OSError, EOFError, pickle.UnpicklingError):
            proc = self._proc
            self._stop()
            self._lost = (f"the writer process of trace {self.path} exited (code {proc.returncode}): the steps it had "
                          "not committed are lost, and the trace is not marked closed")
            raise RecorderError(self._lost) from None
        except BaseException:  # interrupted mid-request (a Ctrl-C, an object that does not pickle): out of step
            self._stop()
            raise
        if status != "ok":
            raise RecorderError(message)

    def commit(self, data) -> None:
        """Commit one step (verify/step_records.py StepData) in the child; returns once it is committed."""
        self._call("step", data)

    def close(self) -> None:
        """Mark the trace closed and end the child (TraceWriter.close's RecorderError is raised here, and one for a
        child that exited before)."""
        if self._proc is None:
            if self._lost is not None:
                raise RecorderError(self._lost)
            return
        try:
            self._call("close", None)
        finally:
            self._stop()

    def _stop(self) -> None:
        """End the child (end of file; killed after 60 s) and give up the claim; later calls are refused."""
        proc, self._proc = self._proc, None
        claim, self._claim = self._claim, None
        try:
            if proc is not None:
                for pipe in (self._requests, self._replies):
                    try:
                        pipe.close()  # end of file for a child still reading: it exits
                    except OSError:  # a child already gone: what was buffered for it goes nowhere
                        pass
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        finally:
            if claim is not None:
                claim.release()

    def __del__(self):
        # Dropped without close(): the child sees end of file and leaves the trace unclosed, as TraceWriter's __del__.
        try:
            if getattr(self, "_proc", None) is not None:
                self._stop()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def main() -> None:
    """The child: serve requests until "close" or end of file (module docstring)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    requests = os.fdopen(int(sys.argv[1]), "rb")
    replies = os.fdopen(int(sys.argv[2]), "wb")
    from verify.step_records import commit_step
    from verify.trace_writer import TraceWriter

    writer = None
    while True:
        try:
            kind, payload = pickle.load(requests)
        except EOFError:
            os._exit(0)  # the recording process is gone: keep what is committed, do not mark the trace closed
        except BaseException:  # noqa: BLE001 - a request cut short or unreadable: the parent sees the exit code
            os._exit(3)
        try:
            if kind == "open":
                writer = TraceWriter(**payload)
            elif kind == "step":
                commit_step(writer, payload)
            else:
                writer.close()
            reply = ("ok", None)
        except Exception as error:  # noqa: BLE001 - relayed to the parent, which raises it
            reply = ("error", str(error) if isinstance(error, RecorderError)
                     else f"writing trace {getattr(writer, 'path', '')}: {type(error).__name__}: {error}")
        try:
            pickle.dump(reply, replies, protocol=pickle.HIGHEST_PROTOCOL)
            replies.flush()
        except OSError:  # the parent is gone
            os._exit(0)
        if kind == "close" or (kind == "open" and writer is None):
            os._exit(0)
