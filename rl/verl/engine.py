"""The trainer side of rl.verl: verl's FSDP engine with the actor's log-probabilities computed by mok's decoder.

`MokFSDPEngineWithLMHead` subclasses verl's `FSDPEngineWithLMHead` and changes two methods:
- `_build_fsdp_module`: FSDP2 over the whole model as one group (verl wraps each decoder layer, the embedding
  and the LM head as groups of their own, whose hooks fire only when their modules are called; mok's decoder
  reads the parameters directly, in one call, inside the root group's forward hooks, as rl.distributed does),
  with verl's mixed-precision policy (param_dtype bf16 by default: the forward computes in the bf16 rounding
  of the fp32 master weights, the weights verl sends vLLM) and its CPU-offload policy;
- `forward_step`: log-probabilities (and entropy when verl asks) through `sequence_logprobs`, in verl's
  layout (nested [B, j1] over prompt + response, position t scoring token t+1), then verl's loss function.
Everything else (optimizer, checkpoints, offloading, weight sync to vLLM) is verl's.

Shapes: docs/shapes.md.
"""
from __future__ import annotations

import types
from collections.abc import Sequence

import torch
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id, get_device_name
from verl.utils.model import extract_multi_modal_inputs
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.engine.utils import detach_tree

import mok
from mok.errors import UnsupportedError
from rl import trace_names
from rl.errors import InputError
from rl.logprobs import GREEDY_TEMPERATURE, sampling_temperature
from rl.models import adapter_for
from rl.models.decoder import check_token_ids, forward_hidden, lm_head

FORWARD_METHOD = "mok_verl_forward"
"""The method on the sharded model that runs mok's decoder inside FSDP2's forward hooks."""

REGISTRY_KEY = dict(model_type="language_model", backend=["fsdp", "fsdp2"], device="cuda", vendor="nvidia")
"""Where the engine is registered in verl's EngineRegistry: (device, vendor) keys are looked up before verl's
own engine, which is registered for the device alone."""


def sequence_logprobs(model: torch.nn.Module, input_ids_T: torch.Tensor, cu_seqlens_B1: torch.Tensor,
                      temperatures: Sequence[float], *, entropy: bool = False, entropy_grad: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probabilities of B packed sequences in verl's layout, through mok's ops.

    model: a supported transformers MoE causal LM whose parameters are plain tensors (unsharded, or inside
    FSDP2's forward hooks). input_ids_T: [T] int64, the sequences one after another (verl's nested
    `input_ids.values()`); cu_seqlens_B1: [B+1] integer offsets (`input_ids.offsets()`), every sequence
    non-empty; temperatures: B floats, one per sequence, each >= GREEDY_TEMPERATURE.
    Returns (logps fp32 [T], entropy fp32 [T] or None). logps[t] = log p(input_ids[t+1] | its sequence up
    to t) under the temperature as vLLM's sampler applies it before its processed log-probabilities (the
    logits in fp32 divided by a fp32 [N, 1] tensor of the temperatures, then mok's log-softmax); 0.0 at
    each sequence's last token, whose successor is not in the sequence (verl never reads it). Positions
    count from 0 in each sequence. Bitwise equal to `rl.logprobs` at temperature 1 (the same decoder and
    ops), and to vLLM's processed log-probabilities with the mok plugin. Differentiable w.r.t. the model's
    parameters (mok's deterministic backward); entropy (of the temperature-scaled distribution) only with
    entropy_grad.
    """
    adapter = adapter_for(model)
    device = adapter.embed.weight.device
    input_ids_T = input_ids_T.to(device=device, dtype=torch.int64)
    offsets_B1 = cu_seqlens_B1.to(device=device, dtype=torch.int64)
    lengths_B = offsets_B1.diff()
    if len(temperatures) != lengths_B.numel():
        raise InputError(f"rl.verl: {len(temperatures)} temperatures for {lengths_B.numel()} sequences")
    if bool((lengths_B <= 0).any()):
        raise InputError("rl.verl: every sequence must hold at least one token")
    bad = [t for t in temperatures if not sampling_temperature(t)]
    if bad:
        raise InputError(f"rl.verl: temperature {bad[0]!r} is not a finite number >= vLLM's greedy threshold "
                         f"{GREEDY_TEMPERATURE}")
    check_token_ids(adapter, input_ids_T)
    sequence_T = torch.repeat_interleave(torch.arange(lengths_B.numel(), device=device), lengths_B)
    positions_T = torch.arange(input_ids_T.numel(), device=device) - offsets_B1[sequence_T]
    hidden_TH = forward_hidden(adapter, input_ids_T, positions_T, offsets_B1.to(torch.int32))
    rows_N = torch.nonzero(positions_T < lengths_B[sequence_T] - 1).squeeze(1)  # tokens with a successor
    temperature_N1 = torch.tensor(list(temperatures), dtype=torch.float32, device=device)[sequence_T[rows_N]][:, None]
    logits_NV = lm_head(adapter, hidden_TH[rows_N]).float() / temperature_N1
    logps_N = mok.logprobs(logits_NV, input_ids_T[rows_N + 1], name=trace_names.LOGPROBS)
    logps_T = logps_N.new_zeros(input_ids_T.numel()).index_put((rows_N,), logps_N)
    if not entropy:
        return logps_T, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        log_softmax_NV = mok.log_softmax(logits_NV if entropy_grad else logits_NV.detach())
        entropy_N = -(log_softmax_NV.exp() * log_softmax_NV).sum(-1)
        return logps_T, entropy_N.new_zeros(input_ids_T.numel()).index_put((rows_N,), entropy_N)


def _sharded_forward(model: torch.nn.Module, input_ids_T: torch.Tensor, cu_seqlens_B1: torch.Tensor,
                     temperatures: tuple[float, ...], entropy: bool, entropy_grad: bool):
    """sequence_logprobs inside FSDP2's forward hooks (parameters all-gathered in the compute dtype around it).
    Temperatures travel as floats: FSDP2 casts floating-point tensor arguments to the compute dtype. The
    results are fresh tensors, not views (FSDP2 hooks the outputs for its backward)."""
    logps_T, entropy_T = sequence_logprobs(model, input_ids_T, cu_seqlens_B1, temperatures, entropy=entropy,
                                           entropy_grad=entropy_grad)
    return logps_T.clone(), None if entropy_T is None else entropy_T.clone()


def check_engine_config(model_config, engine_config) -> None:
    """Refuse (UnsupportedError naming the setting) the engine settings the mok engine does not implement."""
    problems = []
    if engine_config.strategy != "fsdp2":
        problems.append(f"strategy={engine_config.strategy!r} (the mok engine is an FSDP2 engine: set fsdp2)")
    if engine_config.ulysses_sequence_parallel_size != 1:
        problems.append(f"ulysses_sequence_parallel_size={engine_config.ulysses_sequence_parallel_size} "
                        "(mok's decoder computes whole sequences)")
    if getattr(model_config, "use_fused_kernels", False):
        problems.append("use_fused_kernels=True (verl's fused log-prob kernels replace mok's)")
    if getattr(model_config, "use_liger", False):
        problems.append("use_liger=True (Liger kernels replace mok's)")
    if getattr(model_config, "lora_rank", 0):
        problems.append(f"lora_rank={model_config.lora_rank} (mok computes the full model's weights)")
    if getattr(model_config, "enable_activation_offload", False):
        problems.append("enable_activation_offload=True")
    if problems:
        raise UnsupportedError(f"rl.verl: not supported: {problems[0]}")


def _temperatures(value, batch: int) -> tuple[float, ...]:
    """verl's temperature (a float, or a tensor [B] of per-sequence temperatures) as B floats."""
    if isinstance(value, torch.Tensor):
        values = value.detach().float().reshape(-1).cpu().tolist()
        if len(values) not in (1, batch):
            raise InputError(f"rl.verl: {len(values)} temperatures for {batch} sequences")
        return tuple(values) if len(values) == batch else tuple(values * batch)
    return (float(value),) * batch


def check_micro_batch(micro_batch) -> None:
    """Refuse the per-batch modes the mok engine does not compute (UnsupportedError naming them), and
    positions other than 0..n-1 in each sequence (rl.InputError): vLLM numbers every sequence from 0."""
    for key in ("use_fused_kernels", "distillation_use_topk", "calculate_sum_pi_squared"):
        if tu.get_non_tensor_data(data=micro_batch, key=key, default=False):
            raise UnsupportedError(f"rl.verl: not supported: {key}=True")
    # verl's agent loop stores {} per text sample (a stack a truth test refuses); its own extractor reads them
    if extract_multi_modal_inputs(micro_batch.get("multi_modal_inputs", [])):
        raise UnsupportedError("rl.verl: not supported: multimodal inputs")
    input_ids, position_ids = micro_batch["input_ids"], micro_batch.get("position_ids", None)
    if not getattr(input_ids, "is_nested", False):
        raise InputError("rl.verl: input_ids must be verl's nested (no-padding) tensor")
    if position_ids is None:
        return
    if position_ids.dim() != 2:
        raise UnsupportedError("rl.verl: not supported: multi-axis position ids (mrope)")
    offsets_B1 = input_ids.offsets()
    lengths_B = offsets_B1.diff()
    sequence_T = torch.repeat_interleave(torch.arange(lengths_B.numel(), device=lengths_B.device), lengths_B)
    expected_T = torch.arange(int(offsets_B1[-1]), device=lengths_B.device) - offsets_B1[sequence_T]
    if not torch.equal(position_ids.values().to(expected_T.device, torch.int64), expected_T):
        raise InputError("rl.verl: position_ids must count 0, 1, ... in every sequence (as vLLM numbers them)")


class MokFSDPEngineWithLMHead(FSDPEngineWithLMHead):
    """verl's FSDP2 language-model engine with the log-probabilities (old, reference, current policy; entropy)
    computed by mok's decoder. Constructed by verl (EngineRegistry) with verl's arguments: (model_config
    HFModelConfig, engine_config FSDPEngineConfig, optimizer_config, checkpoint_config). Refuses with
    UnsupportedError what it does not implement (check_engine_config) and a model rl cannot run
    (rl.UnsupportedModelError) before the model is sharded."""

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        check_engine_config(model_config, engine_config)
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config)

    def _build_fsdp_module(self, module: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            fully_shard,
            register_fsdp_forward_method,
        )
        from verl.utils.fsdp_utils import fsdp2_load_full_state_dict
        from verl.utils.torch_dtypes import PrecisionType

        adapter_for(module)  # rl.UnsupportedModelError now; the adapter is cached from the unsharded model
        precision = self.engine_config.mixed_precision or {}
        param_dtype = PrecisionType.to_dtype(precision.get("param_dtype", "bf16"))
        reduce_dtype = PrecisionType.to_dtype(precision.get("reduce_dtype", "fp32"))
        if param_dtype == torch.float16:
            raise UnsupportedError("rl.verl: not supported: mixed_precision.param_dtype=fp16")
        self._autocast_dtype, self.scaler = param_dtype, None
        offload = None
        if self.engine_config.offload_policy or self.engine_config.forward_only:  # verl's rule
            self._is_offload_param = self._is_offload_optimizer = False
            offload = CPUOffloadPolicy(pin_memory=True)
            self._uses_fsdp2_cpu_offload_policy = True
        full_state = module.state_dict()
        fully_shard(module, mesh=self.device_mesh, offload_policy=offload,
                    mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                                   cast_forward_inputs=True),
                    reshard_after_forward=self.engine_config.reshard_after_forward)
        fsdp2_load_full_state_dict(module, full_state, self.device_mesh, offload)
        setattr(module, FORWARD_METHOD, types.MethodType(_sharded_forward, module))
        register_fsdp_forward_method(module, FORWARD_METHOD)
        return module

    def forward_step(self, micro_batch, loss_function, forward_only):
        """verl's contract: (loss, {"model_output": {"log_probs": nested fp32 [B, j1], "entropy": ... when
        calculate_entropy}, "loss": float, "metrics": dict}); the loss from verl's loss_function."""
        micro_batch = micro_batch.to(get_device_id())
        check_micro_batch(micro_batch)
        input_ids = micro_batch["input_ids"]
        offsets_B1 = input_ids.offsets()
        temperatures = _temperatures(micro_batch["temperature"], offsets_B1.numel() - 1)
        entropy = bool(tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False))
        logps_T, entropy_T = getattr(self.module, FORWARD_METHOD)(
            input_ids.values(), offsets_B1, temperatures, entropy, not forward_only)
        model_output = {"log_probs": torch.nested.nested_tensor_from_jagged(logps_T, offsets_B1)}
        if entropy:
            model_output["entropy"] = torch.nested.nested_tensor_from_jagged(entropy_T, offsets_B1)
        if loss_function is not None:
            loss, metrics = loss_function(model_output=model_output, data=micro_batch,
                                          dp_group=self.get_data_parallel_group())
        else:
            assert forward_only, "forward_only must be True when loss_function is None"  # verl's own check
            loss, metrics = torch.tensor(1.0, device=get_device_name()), {}
        return loss, {"model_output": detach_tree(model_output), "loss": loss.detach().item(), "metrics": metrics}


def register() -> type:
    """Register MokFSDPEngineWithLMHead in verl's EngineRegistry (REGISTRY_KEY); once per process."""
    return EngineRegistry.register(**REGISTRY_KEY)(MokFSDPEngineWithLMHead)


__all__ = ["MokFSDPEngineWithLMHead", "sequence_logprobs", "check_engine_config", "check_micro_batch", "register"]
