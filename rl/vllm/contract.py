"""The sampler's execution contract (rl/contract.py), computed where the sampler computes: in vLLM's worker.

    from rl.vllm.contract import sampler_contract
    rl.check_contract(rl.contract(trainer_model), sampler_contract(llm))

`worker_contract(model)` runs inside a worker: the runtime part for the worker's device, the model
part from the transformers config vLLM loaded and the dtype it computes in, plus the sampler-only keys
`vllm` (version), `vllm_ops` and `vllm_skip` (the plugin's MOK_VLLM_OPS / MOK_VLLM_SKIP selection, comma
separated; `check_contract` leaves these out by rule, rl.contract.SIDE_KEYS). `sampler_contract(llm)`
gets it from every worker through `llm.apply_model` (vLLM's public API), which ships the function to
the engine process: vLLM needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 in the environment it starts with.
With MOK_TRACE the plugin also writes it into each worker trace's metadata (`execution_contract`).
"""
from __future__ import annotations

import torch

from rl.contract import config_contract, runtime_contract
from rl.errors import ContractMismatchError
from rl.vllm.options import selected_ops, skipped_ops
from rl.vllm.versions import vllm_version


def _embedding_weight(model: torch.nn.Module) -> torch.Tensor | None:
    inner = getattr(model, "model", None)
    weight = getattr(getattr(inner, "embed_tokens", None), "weight", None)
    return weight if isinstance(weight, torch.Tensor) else None


def worker_contract(model: torch.nn.Module | None = None) -> dict:
    """The sampler's contract in this vLLM worker. model: vLLM's model (as `llm.apply_model` passes it), or
    None while vLLM builds the model (the current VllmConfig gives the config, dtype and device)."""
    from rl.vllm import vllm_internals

    vllm_config = vllm_internals.current_vllm_config()
    model_config = getattr(vllm_config, "model_config", None)
    hf_config = getattr(model, "config", None) or getattr(model_config, "hf_config", None)
    weight = None if model is None else _embedding_weight(model)
    if weight is not None:
        dtype, device = weight.dtype, weight.device
    else:
        dtype = model_config.dtype
        device = torch.device("cpu") if vllm_internals.is_cpu() else torch.device("cuda", torch.cuda.current_device())
    return {
        **runtime_contract(device),
        **config_contract(hf_config, dtype),
        "vllm": vllm_version(),
        "vllm_ops": ",".join(sorted(selected_ops())),
        "vllm_skip": ",".join(sorted(skipped_ops())),
    }


def sampler_contract(llm) -> dict:
    """The contract of a running `vllm.LLM`'s workers (they must all agree: ContractMismatchError otherwise)."""
    contracts = llm.apply_model(worker_contract)
    first = contracts[0]
    for other in contracts[1:]:
        if other != first:
            keys = sorted(k for k in set(first) | set(other) if first.get(k) != other.get(k))
            raise ContractMismatchError(f"vLLM workers disagree on their execution contract: {', '.join(keys)}",
                                        {k: (first.get(k), other.get(k)) for k in keys})
    return first


__all__ = ["sampler_contract", "worker_contract"]
