"""Child process for the kill test: records `steps` full steps, printing 'committed <step>' after each,
then records part of one more step and prints 'in flight' and sleeps (or, with --loop, keeps
committing steps as fast as it can) until the parent kills it with SIGKILL. --background: the Recorder writes
from its writer thread ('committed <step>' then means handed over)."""
import sys
import time

import torch

import verify


def step_tensors(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(7, 33, generator=g).bfloat16(), torch.randn(5, generator=g)]


def main(path: str, steps: int, loop: bool, background: bool) -> None:
    rec = verify.Recorder(path, run="killed", meta={"steps": steps}, background=background)
    step = 0
    while loop or step < steps:
        for i, t in enumerate(step_tensors(step)):
            rec.record(f"t{i}", t, kind="output")
        rec.step()
        print(f"committed {step}", flush=True)
        step += 1
    rec.record("t0", step_tensors(step)[0], kind="output")
    print("in flight", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), "--loop" in sys.argv, "--background" in sys.argv)
