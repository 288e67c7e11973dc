"""rl.contract / rl.check_contract: what decides the bits, as a flat JSON-able dict, compared key by key."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import rl
from mok.errors import MokError
from rl.contract import SIDE_KEYS, comparable
from rl.testing import ARCHITECTURES, tiny_model


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_contract_is_flat_json_and_equal_for_two_copies(arch):
    first = rl.contract(rl.wrap(tiny_model(arch, seed=0)))
    second = rl.contract(tiny_model(arch, seed=1))  # other weights, unwrapped: the same contract
    assert first == second
    assert json.loads(json.dumps(first)) == first
    assert all(isinstance(v, (str, int, float, bool, type(None))) for v in first.values())
    rl.check_contract(first, second)
    assert first["arch"] == arch and first["dtype"] == "bfloat16" and first["device"] == "cpu"
    assert first["kernels"] == "reference" and first["cuda_capability"] == "cpu"
    assert first["torch"] == torch.__version__ and first["mok"]
    for key in ("rope_theta", "top_k", "renormalize", "rms_norm_eps", "head_dim", "num_experts", "hidden_size"):
        assert key in first


@pytest.mark.parametrize("arch, change, key", [
    ("qwen3_moe", {"dtype": torch.float32}, "dtype"),
    ("qwen3_moe", {"norm_topk_prob": False}, "renormalize"),
    ("qwen3_moe", {"num_experts_per_tok": 3}, "top_k"),
    ("mixtral", {"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}}, "rope_theta"),
    ("mixtral", {"rms_norm_eps": 1e-5}, "rms_norm_eps"),
    ("olmoe", {"clip_qkv": 2.0}, "clip_qkv"),
    ("qwen3_moe", {"mlp_only_layers": [1]}, "dense_layers"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 32}, "shared_expert_intermediate_size"),
])
def test_contract_changes_with_dtype_and_config_and_check_names_the_key(arch, change, key):
    base = rl.contract(tiny_model(arch))
    changed = rl.contract(tiny_model(arch, **change))
    assert base[key] != changed[key]
    with pytest.raises(rl.ContractMismatchError, match=rf"\b{key}: trainer") as caught:
        rl.check_contract(base, changed)
    assert key in caught.value.differences
    assert caught.value.differences[key] == (base[key], changed[key])


def test_different_architectures_list_every_differing_key():
    qwen, mixtral = rl.contract(tiny_model("qwen3_moe")), rl.contract(tiny_model("mixtral"))
    with pytest.raises(rl.ContractMismatchError) as caught:
        rl.check_contract(qwen, mixtral)
    assert {"arch", "qk_norm", "rope_theta"} <= set(caught.value.differences)
    assert "mok" not in caught.value.differences


def test_side_keys_are_not_compared_but_other_one_sided_keys_are():
    trainer = rl.contract(tiny_model("mixtral"))
    sampler = {**trainer, "vllm": "0.32.0", "vllm_ops": "moe", "vllm_skip": ""}
    assert {"vllm", "vllm_ops", "vllm_skip"} == SIDE_KEYS
    assert comparable(sampler) == trainer
    rl.check_contract(trainer, sampler)  # by rule: only the sampler has a vLLM
    with pytest.raises(rl.ContractMismatchError, match="kernels: trainer 'reference' != sampler <absent>"):
        rl.check_contract(trainer, {k: v for k, v in sampler.items() if k != "kernels"})
    with pytest.raises(rl.ContractMismatchError, match="torch"):
        rl.check_contract(trainer, {**sampler, "torch": "0.0.0"})
    with pytest.raises(rl.ContractMismatchError, match="renormalize"):
        rl.check_contract(trainer, {**sampler, "renormalize": 1})  # True == 1, but not the same value
    assert issubclass(rl.ContractMismatchError, MokError)


def test_contract_survives_a_trace_round_trip(tmp_path):
    import verify

    contract = rl.contract(rl.wrap(tiny_model("qwen2_moe")))
    path = tmp_path / "t.db"
    with verify.Recorder(str(path), run="trainer", meta={"execution_contract": contract}) as recorder:
        recorder.record("x", torch.zeros(2))
        recorder.step(param_grads=False)
    with verify.Trace(str(path)) as trace:
        stored = trace.meta["execution_contract"]
    assert stored == contract
    rl.check_contract(contract, stored)


def test_kernel_configuration_digest_follows_every_kernel_config(monkeypatch):
    """On CUDA the contract names the launch configurations by digest (importable without a GPU)."""
    pytest.importorskip("triton")
    from rl.contract import kernel_configuration

    first = kernel_configuration("cuda")
    assert first.startswith("sha256:") and first == kernel_configuration("cuda")
    assert kernel_configuration("cpu") == "reference"
    import mok.kernels.attention as attention
    import mok.kernels.moe.configs as moe_configs

    monkeypatch.setitem(attention.CONFIGS, "forward", {**attention.CONFIGS["forward"], "BLOCK_M": 64})
    second = kernel_configuration("cuda")
    assert second != first
    monkeypatch.setattr(moe_configs, "BLOCK_K", moe_configs.BLOCK_K * 2)
    assert kernel_configuration("cuda") not in (first, second)


def test_kernel_configuration_digest_is_the_same_in_another_process():
    """The trainer and the sampler compare the digest across processes: no constant of mok.kernels may carry what
    differs between processes (a function's repr holds its address), and importing every module of mok.kernels
    (mok/kernels/native/__main__.py among them) builds nothing and exits nothing."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    from rl.contract import kernel_configuration

    here = kernel_configuration("cuda")
    there = subprocess.run([sys.executable, "-c", "from rl.contract import kernel_configuration; "
                            "print(kernel_configuration('cuda'))"], capture_output=True, text=True, check=True,
                           cwd=Path(__file__).resolve().parents[2])
    assert here.startswith("sha256:") and there.stdout.strip() == here


def test_kernel_constants_leave_out_runtime_caches():
    """The kernels' digest covers their configuration constants, not the caches a process filled (rotary's
    tables are keyed by tuples, which also broke the digest's JSON on CUDA machines)."""
    import types

    from rl.contract import kernel_constants

    module = types.ModuleType("mok.kernels.example")
    module.CONFIGS = {"forward": {"BLOCK_M": 64}}
    module._TABLE_CACHE = {(10000.0, 64, "cuda"): "a tensor"}
    assert kernel_constants([module]) == {"mok.kernels.example.CONFIGS": {"forward": {"BLOCK_M": 64}}}
