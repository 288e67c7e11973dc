"""Multi-head Latent Attention (DeepSeek-V2/V3, Moonlight) in its weight-absorbed form: the one MLA the trainer,
rl.generate and the vLLM plugin (rl/vllm/mla.py) compute, so that a query row gets the same bits on every path.

The form (docs/contracts.md, "Multi-head Latent Attention"): per token, the latent kv_c [A] = rms_norm(first A
features of kv_a_proj(x)) and the shared rope key k_pe [R] = rotary(last R features); per head h, the query's
nope part is absorbed into the latent space, q_latent = q_nope @ W_UK[h] (mok.head_linear, weight W_UK[h]^T
[A, M]), and the attention is MQA (one key/value head) over keys [kv_c, k_pe] [A + R] with values kv_c [A]
(mok.attention, value dim A); the head's output is out_latent @ W_UV[h]^T (mok.head_linear, weight W_UV[h] [W, A]),
then o_proj. W_UK and W_UV are kv_b_proj.weight [Q * (M + W), A] split per head. The KV cache holds [kv_c, k_pe]
per token: vLLM's MLA cache layout. Every product is a mok op, so the bits do not depend on the batch.

Shapes: docs/shapes.md; here A = kv_lora_rank, R = qk_rope_head_dim, M = qk_nope_head_dim, W = v_head_dim.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import mok
from mok.ops.rotary import YarnScaling
from rl import trace_names as names
from rl.models.base import Norm


@dataclass(frozen=True)
class MLAttention:
    """One MLA layer's modules (transformers' DeepseekV3Attention) and numbers."""

    q_proj: nn.Linear | None  # [Q * (M + R), H] when q_lora_rank is None
    q_a_proj: nn.Linear | None  # [q_lora_rank, H] otherwise, then q_a_norm, then q_b_proj [Q * (M + R), q_lora_rank]
    q_a_norm: Norm | None
    q_b_proj: nn.Linear | None
    kv_a_proj: nn.Linear  # kv_a_proj_with_mqa [A + R, H]
    kv_a_norm: Norm  # over A
    kv_b_proj: nn.Linear  # [Q * (M + W), A]
    o_proj: nn.Linear  # [H, Q * W]
    num_heads: int
    nope_dim: int  # M
    rope_dim: int  # R
    value_dim: int  # W
    latent_dim: int  # A
    scale: float  # softmax scale: (M + R) ** -0.5, times mscale_all_dim's yarn mscale squared
    rope_theta: float
    neox_style: bool  # False: interleaved pairs (rope_interleave, DeepSeek's checkpoints and vLLM)
    yarn: YarnScaling | None
    max_positions: int

    # What the decoder's KV cache stores per token: one head of [kv_c, k_pe] keys and kv_c values.
    @property
    def num_kv_heads(self) -> int:
        return 1

    @property
    def head_dim(self) -> int:
        return self.latent_dim + self.rope_dim

    @property
    def value_head_dim(self) -> int:
        return self.latent_dim


def _linear(module: nn.Linear, x: torch.Tensor, name: str | None = None) -> torch.Tensor:
    return mok.linear(x, module.weight, module.bias, name=name)


def absorb_query(q_nope_TQM: torch.Tensor, kv_b_weight: torch.Tensor, nope_dim: int, value_dim: int
                 ) -> torch.Tensor:
    """q_latent [T, Q, A] = per head h, q_nope[:, h] @ W_UK[h] (mok.head_linear with weights W_UK[h]^T [A, M]:
    each head the bits of mok.linear, fp32 sums, one rounding).

    q_nope_TQM: [T, Q, M]; kv_b_weight: kv_b_proj.weight [Q * (M + W), A]."""
    num_heads = q_nope_TQM.shape[1]
    w_uk_QMA = kv_b_weight.view(num_heads, nope_dim + value_dim, -1)[:, :nope_dim]
    return mok.head_linear(q_nope_TQM, w_uk_QMA.transpose(1, 2))


def project_output(out_TQA: torch.Tensor, kv_b_weight: torch.Tensor, nope_dim: int, value_dim: int) -> torch.Tensor:
    """out [T, Q * W] = per head h, out_latent[:, h] @ W_UV[h]^T (mok.head_linear with weights W_UV[h] [W, A]),
    heads concatenated.

    out_TQA: [T, Q, A]; kv_b_weight: kv_b_proj.weight [Q * (M + W), A]."""
    num_heads = out_TQA.shape[1]
    w_uv_QWA = kv_b_weight.view(num_heads, nope_dim + value_dim, -1)[:, nope_dim:]
    return mok.head_linear(out_TQA, w_uv_QWA).flatten(1)


def rotate(attn: MLAttention, x_TQR: torch.Tensor, positions_T: torch.Tensor) -> torch.Tensor:
    """The rope part of queries [T, Q, R] or of the shared key [T, 1, R], rotated (mok.rotary, YaRN if set)."""
    return mok.rotary(x_TQR, positions_T, attn.rope_theta, attn.rope_dim, attn.neox_style,
                      max_positions=attn.max_positions, yarn=attn.yarn)


def forward(attn: MLAttention, x_TH: torch.Tensor, positions_T: torch.Tensor, cu_seqlens_q: torch.Tensor,
            keys_values, index: int) -> torch.Tensor:
    """The attention block of one layer: normed hidden [T, H] -> o_proj output [T, H]. Traced: the latent attention's
    output (`layers.{i}.attention`, [T, Q, A]) and o_proj; the projections run unnamed (vLLM's MLA has no qkv_proj).

    keys_values: rl.models.decoder.KeyValueSource; it receives k [T, 1, A + R] and v [T, 1, A] of the new tokens."""
    num_tokens = x_TH.shape[0]
    if attn.q_proj is not None:
        q_TO = _linear(attn.q_proj, x_TH)
    else:
        q_c_TF = mok.rms_norm(_linear(attn.q_a_proj, x_TH), attn.q_a_norm.weight, attn.q_a_norm.eps)
        q_TO = _linear(attn.q_b_proj, q_c_TF)
    q_TQD = q_TO.reshape(num_tokens, attn.num_heads, attn.nope_dim + attn.rope_dim)
    kv_TF = _linear(attn.kv_a_proj, x_TH)
    kv_c_TA = mok.rms_norm(kv_TF[:, :attn.latent_dim], attn.kv_a_norm.weight, attn.kv_a_norm.eps)
    k_pe_T1R = rotate(attn, kv_TF[:, None, attn.latent_dim:], positions_T)
    q_pe_TQR = rotate(attn, q_TQD[..., attn.nope_dim:], positions_T)
    q_latent_TQA = absorb_query(q_TQD[..., :attn.nope_dim], attn.kv_b_proj.weight, attn.nope_dim, attn.value_dim)
    q_TQD = torch.cat([q_latent_TQA, q_pe_TQR], dim=-1)
    k_T1D = torch.cat([kv_c_TA[:, None], k_pe_T1R], dim=-1)
    k_S1D, v_S1A, cu_seqlens_k = keys_values(index, k_T1D, kv_c_TA[:, None])
    out_TQA = mok.attention(q_TQD, k_S1D, v_S1A, cu_seqlens_q, cu_seqlens_k, attn.scale, causal=True,
                            name=names.layer(index, names.ATTENTION))
    out_TO = project_output(out_TQA, attn.kv_b_proj.weight, attn.nope_dim, attn.value_dim)
    return _linear(attn.o_proj, out_TO, name=names.layer(index, names.O_PROJ))
