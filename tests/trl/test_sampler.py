"""Issue 18, the sampler side: the plugin covers vLLM's processed log-probabilities (temperature, then
top-k/top-p masking, then the log-softmax: mok's) and its raw ones, in compiled mode (no enforce_eager),
served the way TRL serves them.

- `python -m rl.trl serve` (TRL's `trl vllm-serve` with MOK_VLLM=1: processed_logprobs, compiled) answers
  TRL's VLLMClient.generate; every sampled token's log-probability equals the trainer's recomputation
  bitwise: `rl.trl.completion_logprobs` at temperature 0.7 and 1.0, and with top_k/top_p (which rl.trl
  refuses in training, as TRL's trainer does not mask) the wrapped forward's logits / temperature, masked
  by vLLM's own top-k/top-p function, through mok.log_softmax. Weight sync in server mode needs CUDA
  (TRL's NCCL weight-transfer engine), so it is not run here.
- `vllm.LLM(logprobs_mode="raw_logprobs")` at temperature 0.7 with top-k/top-p: the log-probabilities of
  the raw logits, equal to the trainer's at temperature 1.0.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
       "VLLM_CPU_KVCACHE_SPACE": "1"}
for _key in ("MOK_VLLM", "MOK_VLLM_OPS", "MOK_VLLM_SKIP", "MOK_TRACE", "VLLM_PLUGINS"):
    ENV.pop(_key, None)
PROMPT_LENGTHS = [3, 9, 17, 5]
MAX_TOKENS = 8

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from rl.testing import save_tiny_checkpoint

    return save_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("trl_sampler") / "model", seed=0)


@pytest.fixture(scope="module")
def trainer(checkpoint):
    from rl.vllm.testing import load_trainer

    return load_trainer(checkpoint)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _server(checkpoint, log: Path):
    """`python -m rl.trl serve` on 127.0.0.1 (compiled engine); yields TRL's VLLMClient; stops the server."""
    from trl.generation.vllm_client import VLLMClient

    port = _free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "rl.trl", "serve", "--model", str(checkpoint), "--host",
                                 "127.0.0.1", "--port", str(port), "--max-model-len", "256"], cwd=ROOT, env=ENV,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        try:
            client = VLLMClient(base_url=f"http://127.0.0.1:{port}", connection_timeout=300)
        except Exception as error:
            raise AssertionError(f"server did not start ({error}):\n{log.read_text()[-6000:]}") from error
        yield client
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)  # the server and the engine process it started
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _expected_processed(trainer, tokens: list[int], prompt_length: int, temperature: float, top_k: int,
                        top_p: float) -> torch.Tensor:
    """The trainer's processed log-probability of each completion token: wrapped-forward logits / temperature
    (rl.trl.apply_temperature), masked by vLLM's own top-k/top-p function, then mok.log_softmax."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    import mok
    from rl.trl import apply_temperature

    with torch.no_grad():
        logits_LV = trainer(torch.tensor([tokens])).logits[0]
    rows = logits_LV[prompt_length - 1: len(tokens) - 1]
    x_TV = apply_temperature(rows, temperature)
    k = torch.full((x_TV.shape[0],), top_k, dtype=torch.int64) if top_k > 0 else None
    p = torch.full((x_TV.shape[0],), top_p, dtype=torch.float32) if top_p < 1.0 else None
    masked_TV = apply_top_k_top_p(x_TV.clone(), k, p)
    return mok.log_softmax(masked_TV).gather(1, torch.tensor(tokens[prompt_length:])[:, None])[:, 0]


def test_served_processed_logprobs_equal_the_trainer(checkpoint, trainer, tmp_path):
    from rl.trl import completion_logprobs
    from rl.vllm.testing import mixed_prompts

    prompts = mixed_prompts(PROMPT_LENGTHS, seed=3)
    cases = [(0.7, 0, 1.0), (1.0, 0, 1.0), (0.7, 8, 0.9)]
    with _server(checkpoint, tmp_path / "server.log") as client:
        assert client.get_server_info()["model_config"]["logprobs_mode"] == "processed_logprobs"
        outputs = [client.generate(prompts=prompts, n=2, temperature=t, top_k=k, top_p=p, max_tokens=MAX_TOKENS,
                                   logprobs=0) for t, k, p in cases]
    for (temperature, top_k, top_p), out in zip(cases, outputs):
        assert len(out["completion_ids"]) == 2 * len(prompts)
        for i, completion in enumerate(out["completion_ids"]):
            prompt = out["prompt_ids"][i // 2]
            sampled = torch.tensor([lp[0] for lp in out["logprobs"][i]], dtype=torch.float32)
            assert len(completion) > 0 and sampled.shape == (len(completion),)
            expected = _expected_processed(trainer, prompt + completion, len(prompt), temperature, top_k, top_p)
            assert torch.equal(sampled, expected), (temperature, top_k, top_p, i, sampled - expected)
            ids = torch.tensor([prompt + completion])
            ours = completion_logprobs(trainer, ids, torch.ones_like(ids), len(completion), temperature)[0][0]
            if top_k == 0:  # what rl.trl's trainer computes
                assert torch.equal(sampled, ours), (temperature, i)
            else:  # the masks were active: renormalised over the kept tokens, every log-probability is higher
                assert bool((sampled > ours).all()), (i, sampled, ours)


RAW_CHILD = """
import json, sys
from vllm import LLM, SamplingParams
from rl.vllm import plugin
llm = LLM(model=sys.argv[1], logprobs_mode="raw_logprobs", dtype="bfloat16", skip_tokenizer_init=True,
          max_model_len=256, max_num_seqs=8, gpu_memory_utilization=0.1, enable_prefix_caching=False, seed=0)
prompts = json.loads(sys.argv[2])
params = SamplingParams(max_tokens=int(sys.argv[3]), temperature=0.7, top_k=8, top_p=0.9, logprobs=0, detokenize=False,
                        ignore_eos=True, n=2)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
rows = [[o.prompt_token_ids, c.token_ids, [c.logprobs[j][t].logprob for j, t in enumerate(c.token_ids)]]
        for o in outs for c in o.outputs]
print("RESULT " + json.dumps({"rows": rows, "ops": sorted(plugin.registered_ops() or [])}))
"""


def test_raw_logprobs_at_temperature_07_equal_the_trainer_at_10(checkpoint, trainer):
    from rl.trl import completion_logprobs
    from rl.vllm.testing import mixed_prompts

    prompts = mixed_prompts(PROMPT_LENGTHS, seed=4)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(RAW_CHILD), str(checkpoint), json.dumps(prompts),
                           str(MAX_TOKENS)],
                          cwd=ROOT, env={**ENV, "MOK_VLLM": "1"}, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-6000:]
    result = json.loads(lines[0][len("RESULT "):])
    assert "logprobs" in result["ops"]
    assert len(result["rows"]) == 2 * len(prompts)
    for prompt, completion, sampled in result["rows"]:
        ids = torch.tensor([prompt + completion])
        ours = completion_logprobs(trainer, ids, torch.ones_like(ids), len(completion), 1.0)[0][0]
        assert torch.equal(torch.tensor(sampled, dtype=torch.float32), ours), (prompt, completion)
