"""rl.distributed: a wrapped model under FSDP2 (torch.distributed.fsdp.fully_shard), with expert parallelism.

    torch.distributed.init_process_group("nccl")            # or "gloo" on the CPU; one process per device
    model = rl.distributed.shard(rl.wrap(model), ep_size=2)  # in place; every rank calls it
    logprobs = rl.logprobs(model, input_ids, attention_mask) # this rank's sequences; same bits as one process
    logprobs[completion].sum().backward(); optimizer.step()  # any torch optimizer over model.parameters()
    state = rl.distributed.full_state_dict(model)            # full tensors on every rank (collective)

Layout: the world's W ranks form a mesh (W / ep_size data-parallel replicas) x (ep_size expert ranks),
rank = replica * ep_size + expert rank. Every rank trains on its own sequences.
- Dense parameters (embedding, attention, norms, router, lm_head, shared experts): one FSDP2 group over
  all W ranks (sharded on dim 0, all-gathered for the forward and again for the backward, gradients
  reduce-scattered: the mean over ranks). One group for the whole model, because rl's decoder reads
  the parameters in one forward (it does not call the decoder layers' modules, whose hooks FSDP2 would
  need for per-layer groups); in a MoE the dense parameters are the small part.
- Experts with ep_size > 1: expert rank p of every replica keeps the block of E / ep_size experts
  [p * E/ep, (p + 1) * E/ep) of every MoE layer (the other experts' weights are freed) and runs mok.moe
  over its replica's expert-parallel group: each token's rows go to the ranks holding its experts and
  come back, with the bits of one process (mok/distributed.py). FSDP2 ignores these parameters; their
  gradient (the sum over the group's tokens) is summed over the replicas in fp32 (all_reduce) and
  divided by W, so that every parameter's gradient is the mean over ranks, as FSDP2's are.
Bits: per rank, rl.logprobs and the wrapped forward equal one process's on the same sequences
(batch invariance; the experts' exchange keeps them). With one replica (ep_size = W) the experts'
gradients equal one process's over the ranks' sequences one rank after another, divided by W. The
dense gradients are reduced across ranks (FSDP2), so a run is reproducible at a given world size but
not equal to one process's run. tests/distributed/test_fsdp.py proves the three.

Not covered: rl.generate on a sharded model (sample with vLLM, or with rl.generate on an unsharded copy
loaded from full_state_dict), calling `model.model` (transformers' own forward) after sharding.

Shapes: docs/shapes.md.
"""
from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch import nn

from mok.distributed import local_experts
from rl.errors import UnsupportedModelError
from rl.models import adapter_for
from rl.models.base import SparseMoE
from rl.wrap import wrap

_EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def shard(model: nn.Module, *, ep_size: int = 1, reshard_after_forward: bool = True) -> nn.Module:
    """FSDP2 over all ranks for the dense parameters, and expert parallelism of degree ep_size (in place;
    returns the same object, wrapped by rl.wrap if it was not). Every rank calls it, with the same model
    (same weights: each rank keeps its shard) on its device. Collective; torch.distributed must be
    initialised. ep_size must divide the world size and every MoE layer's expert count
    (UnsupportedModelError otherwise)."""
    if not dist.is_available() or not dist.is_initialized():
        raise UnsupportedModelError("rl.distributed.shard: torch.distributed is not initialised (init_process_group)")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    world = dist.get_world_size()
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1 or world % ep_size:
        raise UnsupportedModelError(f"rl.distributed.shard: ep_size must be an int >= 1 dividing the world size "
                                    f"{world}, got {ep_size!r}")
    if getattr(model, "_mok_sharded_logprobs", None) is not None:
        raise UnsupportedModelError("rl.distributed.shard: the model is already sharded")
    wrap(model)
    adapter = adapter_for(model)  # built (and cached) from the full model, before any expert is dropped
    device = adapter.embed.weight.device
    moe_layers = [layer.mlp for layer in adapter.layers if isinstance(layer.mlp, SparseMoE)]
    for moe in moe_layers:
        num_experts = moe.experts.gate_up_proj.shape[0]
        if num_experts % ep_size:
            raise UnsupportedModelError(f"rl.distributed.shard: {num_experts} experts per layer are not divisible by "
                                        f"ep_size={ep_size}")
    expert_params: dict[str, object] = {}
    if ep_size > 1:
        mesh = init_device_mesh(device.type, (world // ep_size, ep_size), mesh_dim_names=("dp", "ep"))
        ep_group, dp_group = mesh.get_group("ep"), mesh.get_group("dp")
        names = {id(p): name for name, p in model.named_parameters()}
        for moe in moe_layers:
            block = local_experts(moe.experts.gate_up_proj.shape[0], ep_group)
            for field in _EXPERT_PARAMS:
                full = getattr(moe.experts, field)
                name = names[id(full)]
                local = nn.Parameter(full.detach()[block.start:block.stop].clone(), requires_grad=full.requires_grad)
                setattr(moe.experts, field, local)
                local.register_hook(_expert_grad_hook(dp_group, world))
                expert_params[name] = local
            moe.experts.mok_ep_group = ep_group
        object.__setattr__(model, "_mok_expert_groups", {name: ep_group for name in expert_params})
    fully_shard(model, mesh=init_device_mesh(device.type, (world,)), reshard_after_forward=reshard_after_forward,
                ignored_params=set(expert_params.values()) or None)
    model._mok_sharded_logprobs = types.MethodType(_sharded_logprobs, model)
    register_fsdp_forward_method(model, "_mok_sharded_logprobs")
    return model


def _sharded_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """rl.logprobs' body inside FSDP2's forward hooks (parameters all-gathered around it). The result is
    returned as a fresh tensor, not a view (FSDP2 hooks the output for its backward)."""
    from rl.logprobs import packed_logprobs

    return packed_logprobs(model, input_ids, attention_mask).clone()


def _expert_grad_hook(dp_group, world: int):
    """d expert weights of this rank -> their sum over the data-parallel replicas (fp32), divided by W."""
    replicas = dist.get_world_size(dp_group)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        total = grad.float()  # a copy for 16-bit weights; cloned below for fp32
        if total.data_ptr() == grad.data_ptr():
            total = total.clone()
        if replicas > 1:
            dist.all_reduce(total, group=dp_group)
        return (total / world).to(grad.dtype)

    return hook


def is_sharded(model: nn.Module) -> bool:
    return getattr(model, "_mok_sharded_logprobs", None) is not None


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every entry of model.state_dict() as the full tensor, on every rank (collective: every rank calls it).

    FSDP2 shards are all-gathered; expert blocks are gathered over their expert-parallel group and put
    back in expert order, so the result has the unsharded model's names, shapes and values."""
    from torch.distributed.tensor import DTensor

    groups = getattr(model, "_mok_expert_groups", {})
    out = {}
    for name, tensor in model.state_dict().items():
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        elif name in groups:
            tensor = _gather_rows(tensor.detach(), groups[name])
        out[name] = tensor.detach()
    return out


def _gather_rows(block: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's block (equal shapes) along dim 0 in group-rank order, through raw bytes."""
    size = dist.get_world_size(group)
    as_bytes = block.contiguous().view(torch.uint8)
    parts = [torch.empty_like(as_bytes) for _ in range(size)]
    dist.all_gather(parts, as_bytes, group=group)
    return torch.cat([part.view(block.dtype) for part in parts])
