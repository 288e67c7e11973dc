"""The contract helpers' arguments: a device that is not there or not a device, a contract that is not a dict,
a dtype that is not one: rl.InputError (rl.UnsupportedModelError for the model), never a raw exception; and
a NaN in a contract equals itself."""
from __future__ import annotations

import math

import pytest
import torch

import rl
from rl.contract import check_contract, comparable, config_contract, contract, kernel_configuration, runtime_contract
from rl.testing import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3_moe", seed=0)


BAD_DEVICES = ["bogus", None, 3.5, "meta", "cuda:99" if torch.cuda.is_available() else "cuda", [0]]


@pytest.mark.parametrize("device", BAD_DEVICES, ids=repr)
def test_runtime_contract_refuses_a_device_it_cannot_compute_on(device):
    with pytest.raises(rl.InputError, match="device"):
        runtime_contract(device)


@pytest.mark.parametrize("device", ["bogus", None, 3.5, [0]], ids=repr)
def test_kernel_configuration_refuses_what_is_not_a_device(device):
    with pytest.raises(rl.InputError, match="device"):
        kernel_configuration(device)


@pytest.mark.parametrize("dtype", ["nonsense", 3, None, "torch.int", torch.int64])
def test_config_contract_refuses_what_is_not_a_float_dtype(model, dtype):
    with pytest.raises(rl.InputError, match="dtype"):
        config_contract(model.config, dtype)


def test_config_contract_takes_a_dtype_or_its_name(model):
    expected = config_contract(model.config, torch.bfloat16)
    assert config_contract(model.config, "bfloat16") == expected == config_contract(model.config, "torch.bfloat16")


@pytest.mark.parametrize("bad", [None, [1], "ab", 3, {1: "x"}], ids=repr)
def test_contracts_must_be_dicts(bad):
    with pytest.raises(rl.InputError, match="contract"):
        comparable(bad)
    with pytest.raises(rl.InputError, match="contract"):
        check_contract(bad, {"a": 1})
    with pytest.raises(rl.InputError, match="contract"):
        check_contract({"a": 1}, bad)


def test_a_nan_in_a_contract_equals_itself(model):
    trainer = {**contract(model), "extra": math.nan}
    check_contract(trainer, dict(trainer))
    with pytest.raises(rl.ContractMismatchError) as caught:
        check_contract(trainer, {**trainer, "extra": 1.0})
    assert list(caught.value.differences) == ["extra"]


@pytest.mark.parametrize("bad", [None, torch.nn.Linear(2, 2), "qwen3_moe"], ids=repr)
def test_contract_of_what_is_not_a_model(bad):
    with pytest.raises(rl.UnsupportedModelError):
        contract(bad)


def test_contract_of_a_meta_model_is_refused():
    import transformers

    from rl.testing import tiny_config

    with torch.device("meta"):
        model = transformers.OlmoeForCausalLM(tiny_config("olmoe"))
    with pytest.raises(rl.UnsupportedModelError, match="meta device"):
        contract(model)
