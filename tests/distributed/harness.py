"""Multi-process tests without a launcher: the test spawns its ranks itself.

Parent side: `run_ranks(module, world_size, backend)` starts `world_size` fresh Python processes running
this file, waits for them (killing every one of them, by pid, past the timeout) and returns each rank's
verdicts {case: "ok", "skip: why" or a traceback}. Child side: joins the process group through a file
store (no port to pick), runs every case of `module.CASES` in order with a `Rank` context, and writes its
verdicts as JSON. Cases are collective: every rank runs the same cases in the same order. A failing case
can leave the other ranks waiting in a collective, so the group has a short timeout and the verdicts of
later cases on that run may be failures too (the first failure is the one to read).

    python -m tests.distributed.harness MODULE RANK WORLD BACKEND DIR   # what the parent runs per rank
"""
from __future__ import annotations

import dataclasses
import datetime
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SKIP = "skip: "
BACKEND_WORLDS = [  # (process-group backend, world size): gloo on the CPU in CI, NCCL where GPUs are present
    ("gloo", 2),
    ("gloo", 4),
    pytest.param("nccl", 1, marks=pytest.mark.gpu),
    pytest.param("nccl", 2, marks=pytest.mark.multigpu(2)),
    pytest.param("nccl", 4, marks=pytest.mark.multigpu(4)),
    pytest.param("nccl", 8, marks=pytest.mark.multigpu(8)),
]


class Cases(dict):
    """Named collective cases (functions of a `Rank`), in registration order."""

    def case(self, fn: Callable) -> Callable:
        if fn.__name__ in self:
            raise ValueError(f"duplicate case {fn.__name__!r}")
        self[fn.__name__] = fn
        return fn


class Skip(Exception):
    """Raised by a case that does not apply to this world size (its verdict becomes 'skip: <message>')."""


@dataclasses.dataclass
class Rank:
    rank: int
    world_size: int
    backend: str
    device: object  # torch.device
    out_dir: Path
    args: dict


def run_ranks(module: str, world_size: int, backend: str = "gloo", *, timeout: float = 300,
              args: dict | None = None, env: dict | None = None, out_dir: Path | None = None) -> list[dict[str, str]]:
    """Run the cases of `module` on `world_size` ranks; -> one verdict dict per rank (raises when a rank
    wrote none, with the tail of its log). args (JSON) reach the cases as `ctx.args`; args["only"]: run
    only these cases. out_dir (default: a fresh temporary folder): the cases' `ctx.out_dir`."""
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="mok-ranks-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "args.json").write_text(json.dumps(args or {}))
    child_env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                     OMP_NUM_THREADS="1", **(env or {}))
    procs, logs = [], []
    for rank in range(world_size):
        log = open(out / f"rank{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tests.distributed.harness", module, str(rank), str(world_size), backend, str(out)],
            cwd=REPO, env=child_env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    timed_out = False
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    if timed_out:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for log in logs:
        log.close()
    verdicts = []
    for rank in range(world_size):
        path = out / f"rank{rank}.json"
        if not path.exists():
            tail = (out / f"rank{rank}.log").read_text()[-4000:]
            raise AssertionError(f"rank {rank} of {world_size} wrote no verdicts "
                                 f"({'timed out' if timed_out else f'exit {procs[rank].returncode}'}):\n{tail}")
        verdicts.append(json.loads(path.read_text()))
    return verdicts


def check(verdicts: list[dict[str, str]], case: str) -> None:
    """Assert `case` passed on every rank (pytest.skip when every rank skipped it)."""
    import pytest

    got = [v.get(case, "missing") for v in verdicts]
    if all(g.startswith(SKIP) for g in got):
        pytest.skip(got[0][len(SKIP):])
    bad = [(rank, g) for rank, g in enumerate(got) if g != "ok"]
    assert not bad, "\n".join(f"rank {rank}: {g}" for rank, g in bad)


def _main(module: str, rank: int, world_size: int, backend: str, out: Path) -> int:
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"file://{out}/store", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=90 if backend == "gloo" else 300))
    ctx = Rank(rank, world_size, backend, device, out, json.loads((out / "args.json").read_text()))
    cases = importlib.import_module(module).CASES
    only = ctx.args.get("only")
    verdicts = {}
    for name, fn in cases.items():
        if only is not None and name not in only:
            continue
        try:
            fn(ctx)
            verdicts[name] = "ok"
        except Skip as why:
            verdicts[name] = SKIP + str(why)
        except Exception:
            verdicts[name] = traceback.format_exc()
    (out / f"rank{rank}.json").write_text(json.dumps(verdicts))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    # Through the package module, so that `Skip` here is the class the cases raise (run as a script, this file's
    # own Skip would be __main__.Skip and a case's skip would be reported as a failure).
    from tests.distributed import harness

    sys.exit(harness._main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], Path(sys.argv[5])))
