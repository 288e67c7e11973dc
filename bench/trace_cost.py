"""What tracing costs a trainer step: `rl.logprobs` forward + backward of bench/step.py's model (a Qwen3-30B-A3B
slice, 4 layers) with tracing off and on, eager and under torch.compile, same run, one GPU.

Per workload, `off_ms` (no observer) and, per way of tracing, `on_ms`, `overhead` (on / off - 1) and the trace's
bytes per recorded step:
    eager_recorder   verify.Recorder.record as the observer of every mok op, parameter gradients recorded
    tap              Recorder.capture's DeviceTap (verify/capture.py) as the observer, every step recorded
    tap_every<N>     the same at the rate every=N (one step in N recorded; the mean over all steps)
    tap_background, tap_background_every<N>
                     the same with Recorder(background=True): the steps are written while the next runs
    tap_background_every<N>_rows<M>
                     and row_every=M: the row digests of about one row in M kept (all rows still hashed)
A traced step includes `rec.step()` (the ring harvested, the records written to SQLite). The clock runs over
whole periods of the rate, as in a long run: from an idle GPU at a recorded step to just before the next period's
recorded step, each recorded step's background write overlapping the rest of its period (and a write still running
at the next recorded step waited for there), then until the last step's records are committed. Writes JSON lines and,
with --json, bench/results/trace-cost-latest.json. --profile: where a traced step's time goes instead (the
GPU's kernels and the host's functions of one eager step with the tap, bench/kernel_profile.py's tables).

    python -m bench.trace_cost --json bench/results/trace-cost-latest.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import torch

import rl
from bench.step import QWEN3_30B_A3B_LAYERS
from mok import hooks
from rl.testing import tiny_model


def _wall_ms(fn, iters: int, finish=lambda: None) -> float:
    """Host wall-clock ms per call of fn() from an idle GPU until its work (and finish()) is done."""
    finish()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(iters):
        fn()
    finish()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3 / iters


def _traced(step, path: str, how: str, every: int, row_every: int, background: bool, iters: int) -> dict:
    """Times `iters` traced steps, whole periods of `every` (after one warm-up period) -> on_ms and bytes per
    recorded step."""
    from verify import Recorder

    with Recorder(path, every=every, row_every=row_every, overwrite=True, background=background) as rec:
        observer = rec.capture("cuda") if how == "tap" else (lambda name, t, kind: rec.record(name, t, kind=kind))
        with hooks.observe(observer):
            def traced_step():
                step()
                rec.step(param_grads=how == "eager_recorder")

            for _ in range(every):  # the warm-up period: the clock starts at a recorded step
                traced_step()
            ms = _wall_ms(traced_step, -(-iters // every) * every, finish=rec.flush)  # the last write counts too
            recorded = -(-rec.current_step // every)
    return dict(on_ms=ms, trace_bytes_per_step=os.path.getsize(path) / max(recorded, 1))


def bench(workload: str, step, iters: int, rate: int, row_rate: int, ways: list[str], out_dir: str) -> dict:
    step()
    step()
    row = dict(workload=workload, off_ms=_wall_ms(step, iters))
    for way in ways:
        how = "eager_recorder" if way == "eager_recorder" else "tap"
        every = rate if f"_every{rate}" in way else 1
        row_every = row_rate if way.endswith(f"_rows{row_rate}") else 1
        try:
            traced = _traced(step, os.path.join(out_dir, f"{workload}-{way}.db"), how, every, row_every,
                             "_background" in way, max(iters, 2 * every))
            traced["overhead"] = traced["on_ms"] / row["off_ms"] - 1
        except Exception as error:  # a way that does not run here is reported, the others still measured
            traced = dict(error=f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
        row[way] = traced
    return row


def profile_traced(step, path: str, top: int = 15) -> dict:
    """Kernel and host tables of one step traced by the tap (after a recorded warm-up step)."""
    from bench.kernel_profile import host_table, kernel_table
    from verify import Recorder

    with Recorder(path, overwrite=True) as rec, hooks.observe(rec.capture("cuda")):
        def traced_step():
            step()
            rec.step(param_grads=False)

        traced_step()
        kernels = kernel_table(traced_step, calls=1)
        host = host_table(traced_step, calls=1, top=top)
    return dict(kernels=kernels[:top], host=host)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="8x4096", help="batch x length")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--rate", type=int, default=10, help="every=N of the sampled tap")
    parser.add_argument("--row-rate", type=int, default=8, help="row_every=M of the sampled tap")
    parser.add_argument("--workloads", default="trainer_eager,trainer_compiled")
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", action="store_true", help="where the time of a tapped eager step goes")
    args = parser.parse_args()
    import triton

    batch, length = (int(x) for x in args.config.split("x"))
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(), model="qwen3-30b-a3b 4 layers", batch=batch, length=length,
                command=f"python -m bench.trace_cost --workloads {args.workloads} "
                        "--json bench/results/trace-cost-latest.json",
                date=time.strftime("%Y-%m-%d"))
    print(json.dumps(dict(kind="meta", **meta)), flush=True)
    model = rl.wrap(tiny_model("qwen3_moe", seed=0, device="cuda", **QWEN3_30B_A3B_LAYERS))
    model.train()
    gen = torch.Generator(device="cuda").manual_seed(0)
    input_ids_BL = torch.randint(3, QWEN3_30B_A3B_LAYERS["vocab_size"], (batch, length), device="cuda", generator=gen)
    mask_BL = torch.ones_like(input_ids_BL)

    def loss():
        return rl.logprobs(model, input_ids_BL, mask_BL).sum()

    compiled_loss = torch.compile(loss)
    taps = ["tap", f"tap_every{args.rate}", "tap_background", f"tap_background_every{args.rate}",
            f"tap_background_every{args.rate}_rows{args.row_rate}"]
    steps = {"trainer_eager": (loss, ["eager_recorder", *taps]), "trainer_compiled": (compiled_loss, taps)}
    rows = []
    with tempfile.TemporaryDirectory() as out_dir:
        if args.profile:
            def eager_step():
                model.zero_grad(set_to_none=True)
                loss().backward()

            eager_step()
            print(json.dumps(dict(kind="profile", **profile_traced(eager_step, os.path.join(out_dir, "p.db")))),
                  flush=True)
            return
        for workload in args.workloads.split(","):
            forward, ways = steps[workload]

            def step(forward=forward):
                model.zero_grad(set_to_none=True)
                forward().backward()

            rows.append(bench(workload, step, args.iters, args.rate, args.row_rate, ways, out_dir))
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, workloads=rows), f, indent=1)


if __name__ == "__main__":
    main()
