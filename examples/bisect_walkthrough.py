"""Bisect walkthrough: find the commit that made a training run nondeterministic, and the first op it broke.

    python -m examples.bisect_walkthrough            # makes a throwaway git repo, runs mok-verify bisect
    python -m examples.bisect_walkthrough --keep DIR # keep the repository in DIR to look at it

The script writes a tiny training script (plain torch + verify.Recorder: a two-layer MoE-like MLP on
fixed data, a few SGD steps, every op's output and every gradient fingerprinted) and commits it with
four changes. One of them, "speed up the expert combine", replaces the fixed-order combine of expert
outputs with an atomic-add style scatter: contributions are added in an order that changes from run
to run (as float atomics on a GPU do), and fp32 addition is not associative. Then it runs

    mok-verify bisect --repo REPO --good <first> --bad <last> --cmd "python train.py {output}"

which runs the script at each revision it tests (in a worktree), compares each trace with the good
revision's, and names the first revision whose trace differs, with the first op that differs
(`combine`), the step and the rows (tokens).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TRAIN_V1 = '''\
"""A tiny training run that records every op's output and gradient with verify (one trace step per step)."""
import sys

import torch

import verify

T, H, E, STEPS = 64, 32, 4, 3

# One thread: how the BLAS library splits a product among threads (and how many threads it takes on a
# busy machine) can change the bits from run to run; here only the commit under test may change them.
torch.set_num_threads(1)


def combine(expert_out_ETH, gate_TE):
    """Weighted sum of the experts' outputs per token, experts in a fixed order (fp32)."""
    out_TH = torch.zeros_like(expert_out_ETH[0])
    for e in range(expert_out_ETH.shape[0]):
        out_TH = out_TH + gate_TE[:, e:e + 1] * expert_out_ETH[e]
    return out_TH


def main(output):
    generator = torch.Generator().manual_seed(0)
    x_TH = torch.randn(T, H, generator=generator)
    target_TH = torch.randn(T, H, generator=generator)
    w_in_EHH = (0.3 * torch.randn(E, H, H, generator=generator)).requires_grad_()
    w_gate_HE = (0.3 * torch.randn(H, E, generator=generator)).requires_grad_()
    params = [w_in_EHH, w_gate_HE]
    with verify.Recorder(output, run="train", meta={"seed": 0}) as rec:
        for step in range(STEPS):
            gate_TE = torch.softmax(x_TH @ w_gate_HE, dim=-1)
            rec.record("gate", gate_TE)
            expert_out_ETH = torch.tanh(torch.einsum("th,ehk->etk", x_TH, w_in_EHH))
            rec.record("experts", expert_out_ETH)
            out_TH = combine(expert_out_ETH, gate_TE)
            rec.record("combine", out_TH)
            loss = ((out_TH - target_TH) ** 2).mean()
            rec.record("loss", loss)
            loss.backward()
            for name, p in zip(["w_in", "w_gate"], params):
                rec.record(name, p.grad, kind="param")
            rec.step(param_grads=False)
            with torch.no_grad():
                for p in params:
                    p -= LEARNING_RATE * p.grad
                    p.grad = None


LEARNING_RATE = 0.1

if __name__ == "__main__":
    main(sys.argv[1])
'''

# Each change: (commit subject, old text, new text). The third one breaks run-to-run determinism.
CHANGES = [
    ("train: document the shapes",
     '"""A tiny training run',
     '"""Shapes: T tokens, H hidden, E experts.\n\nA tiny training run'),
    ("train: print the final loss",
     "                    p.grad = None\n",
     "                    p.grad = None\n        print(f\"final loss {loss.item():.6f}\")\n"),
    ("combine: speed up the expert combine with a scatter-add",
     '''    out_TH = torch.zeros_like(expert_out_ETH[0])
    for e in range(expert_out_ETH.shape[0]):
        out_TH = out_TH + gate_TE[:, e:e + 1] * expert_out_ETH[e]
    return out_TH''',
     '''    # One scatter-add of all (token, expert) contributions. The order is whatever the workers finish in,
    # like float atomics on a GPU: simulated by a permutation that changes from run to run.
    num_experts, num_tokens, hidden = expert_out_ETH.shape
    contrib_NH = (gate_TE.t()[:, :, None] * expert_out_ETH).reshape(-1, hidden)
    token_N = torch.arange(num_tokens).repeat(num_experts)
    seed = int.from_bytes(os.urandom(4), "little")
    order_N = torch.randperm(contrib_NH.shape[0], generator=torch.Generator().manual_seed(seed))
    return torch.zeros_like(expert_out_ETH[0]).index_add(0, token_N[order_N], contrib_NH[order_N])'''),
    ("train: more steps",
     "T, H, E, STEPS = 64, 32, 4, 3",
     "T, H, E, STEPS = 64, 32, 4, 4"),
]
BAD_SUBJECT = CHANGES[2][0]


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "walkthrough", "GIT_AUTHOR_EMAIL": "walkthrough@example.com",
           "GIT_COMMITTER_NAME": "walkthrough", "GIT_COMMITTER_EMAIL": "walkthrough@example.com"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


def make_repository(repo: Path) -> list[str]:
    """A git repository in `repo` with the training script and the four changes; returns commit hashes."""
    repo.mkdir(parents=True, exist_ok=True)
    git(repo, "init", "-q", "-b", "main")
    script = repo / "train.py"
    script.write_text(TRAIN_V1)
    git(repo, "add", "train.py")
    git(repo, "commit", "-q", "-m", "train: a tiny run that records every op")
    commits = [git(repo, "rev-parse", "HEAD")]
    for subject, old, new in CHANGES:
        text = script.read_text()
        assert old in text, subject
        text = text.replace(old, new, 1)
        if "os.urandom" in text and "import os\n" not in text:
            text = text.replace("import sys\n", "import os\nimport sys\n", 1)
        script.write_text(text)
        git(repo, "commit", "-q", "-am", subject)
        commits.append(git(repo, "rev-parse", "HEAD"))
    return commits


def run_bisect(repo: Path, good: str, bad: str) -> tuple[int, dict]:
    """`mok-verify bisect ... --json` as a user would run it; returns (exit code, parsed JSON)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "verify.cli", "bisect", "--repo", str(repo), "--good", good, "--bad", bad,
               "--cmd", f"{sys.executable} train.py {{output}}", "--json"]
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"mok-verify bisect failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc.returncode, json.loads(proc.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", type=Path, help="create the repository here and keep it")
    parser.add_argument("--json", action="store_true", help="print the bisect result as JSON")
    args = parser.parse_args(argv)

    tmp = None
    if args.keep is None:
        tmp = tempfile.mkdtemp(prefix="mok-bisect-walkthrough-")
        repo = Path(tmp) / "repo"
    else:
        repo = args.keep
        if repo.exists() and any(repo.iterdir()):
            raise SystemExit(f"bisect_walkthrough: {repo} is not empty")
    try:
        commits = make_repository(repo)
        say = (lambda *a: None) if args.json else print
        say(f"throwaway repository: {repo}")
        say(git(repo, "log", "--oneline", "--reverse"))
        say(f"\n$ mok-verify bisect --repo {repo} --good {commits[0][:12]} --bad {commits[-1][:12]} "
            f"--cmd 'python train.py {{output}}'")
        code, result = run_bisect(repo, commits[0], commits[-1])
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            tested = ", ".join(f"{rev[:12]} {status}" for rev, status in result["tested"])
            print(f"tested: {tested}")
            print(f"first diverging revision: {result['first_bad']} {result['subject']}")
            divergence = result["divergence"]["divergence"]
            where = divergence["a"] or divergence["b"]
            rows = (f", rows {divergence['rows'][:8]}{' ...' if divergence['n_rows_differ'] > 8 else ''} "
                    f"({divergence['n_rows_differ']} of {divergence['n_rows']} differ)"
                    if divergence.get("rows") is not None else "")
            print(f"first divergent op: '{where['name']}' [{where['kind']}] at step {where['step']}{rows}")
            found = result["first_bad"] == commits[3] and where["name"] == "combine"
            print("-> the scatter-add commit, and the op it changed, found" if found else "-> unexpected result")
        return 0 if code == 1 and result["first_bad"] == commits[3] else 1
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
