"""What a user-facing workload gains from mok's launch machinery (docs/kernels.md "Launch"), one launch path at a
time, each in its own process on the same GPU:

- `native`: the default: the C++ native eager path, launch plans and cached launches;
- `plans`:  MOK_NATIVE=0: launch plans and cached launches, no C++;
- `triton`: Triton's own launcher for every kernel (`launch.CACHED_LAUNCH_ENABLED = False`: no cached launches,
  no plans, no native path).

Workloads on a Qwen3-30B-A3B slice (bench/step.py's 4 layers, random bf16 weights): the trainer step
(`rl.logprobs` forward + backward) at 1 x 4096 and 8 x 4096 tokens, and `rl.generate` (256-token prompts, 64
sampled tokens, batch 1 and 32) in sampled tokens per second of wall clock. Every path must give the same bits:
the run digests the step's log-probabilities and gradients and the generated tokens, and the summary says whether
the three paths agree.

    python bench/launch_paths.py --json bench/results/launch-latest.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

import torch

PATHS = ("native", "plans", "triton")
STEP_CONFIGS = ((1, 4096), (8, 4096))
GENERATE_CONFIGS = ((1, 256, 64), (32, 256, 64))  # prompts, prompt tokens, sampled tokens


def _digest(*tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def measure(path: str, iters: int) -> dict:
    """One launch path, in this process (its switches are set before mok runs a kernel)."""
    import rl
    from bench.step import QWEN3_30B_A3B_LAYERS
    from bench.timing import cuda_ms
    from mok.kernels import launch
    from rl.testing import tiny_model

    if path == "triton":
        launch.CACHED_LAUNCH_ENABLED = False
    model = rl.wrap(tiny_model("qwen3_moe", seed=0, device="cuda", **QWEN3_30B_A3B_LAYERS))
    vocab = QWEN3_30B_A3B_LAYERS["vocab_size"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    row: dict = dict(path=path)
    for batch, length in STEP_CONFIGS:
        ids_BL = torch.randint(3, vocab, (batch, length), device="cuda", generator=gen)
        mask_BL = torch.ones_like(ids_BL)

        def step():
            model.zero_grad(set_to_none=True)
            logprobs = rl.logprobs(model, ids_BL, mask_BL)
            logprobs.sum().backward()
            return logprobs

        logprobs = step()
        row[f"step_{batch}x{length}_digest"] = _digest(logprobs, *(p.grad for p in model.parameters()
                                                                   if p.grad is not None))
        ms = cuda_ms(step, warmup=1, iters=iters)
        row[f"step_{batch}x{length}_tokens_per_s"] = round(batch * length / ms * 1e3)
    model.zero_grad(set_to_none=True)
    for prompts, length, new_tokens in GENERATE_CONFIGS:
        ids = torch.randint(3, vocab, (prompts, length), generator=torch.Generator().manual_seed(prompts)).tolist()

        def sample():
            return rl.generate(model, ids, max_new_tokens=new_tokens, temperature=1.0, seed=1)

        sample()  # compiles the decode shapes
        best = float("inf")
        for _ in range(iters):
            torch.cuda.synchronize()
            start = time.perf_counter()
            result = sample()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        key = f"generate_{prompts}x{length}+{new_tokens}"
        row[f"{key}_digest"] = _digest(torch.tensor(result.tokens), *result.logprobs)
        row[f"{key}_tokens_per_s"] = round(prompts * new_tokens / best, 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.iters)), flush=True)
        return
    import triton

    rows = []
    for path in args.paths.split(","):
        env = dict(os.environ, MOK_NATIVE="0" if path != "native" else "1")
        done = subprocess.run([sys.executable, "-m", "bench.launch_paths", "--child", path, "--iters", str(args.iters)],
                              env=env, capture_output=True, text=True)
        if done.returncode != 0:
            rows.append(dict(path=path, error=done.stderr.strip().splitlines()[-1:]))
        else:
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    measured = [r for r in rows if "error" not in r]
    digests = sorted({k for r in measured for k in r if k.endswith("_digest")})
    same_bits = all(len({r.get(k) for r in measured}) == 1 for k in digests)
    ratios = {}
    if measured and measured[0]["path"] == "native":
        for key in (k for k in measured[0] if k.endswith("_tokens_per_s")):
            ratios[key.removesuffix("_tokens_per_s")] = {r["path"]: round(r[key] / measured[0][key], 3)
                                                         for r in measured[1:]}
    summary = dict(meta=dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                             model="qwen3-30b-a3b 4 layers", command="python bench/launch_paths.py"),
                   paths=rows, same_bits=same_bits, ratio_to_native=ratios)
    print(json.dumps(dict(same_bits=same_bits, ratio_to_native=ratios)), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    sys.exit(0 if same_bits and len(measured) == len(rows) else 1)


if __name__ == "__main__":
    main()
