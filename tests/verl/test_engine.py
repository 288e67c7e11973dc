"""The mok engine inside verl's real FSDP2 engine machinery (verl's configs, model loading, FSDP2 set-up,
infer_batch, micro-batching and padding helpers), on the CPU, against independent paths: `rl.logprobs` of the
bf16 checkpoint (temperature 1), the wrapped forward's bf16 logits divided by a fp32 temperature then
mok.log_softmax (what vLLM's sampler does before its processed log-probabilities), and verl's stock engine
as the negative control."""
from __future__ import annotations

import pytest
import torch

import mok
import rl
from tests.verl.batches import engine_logprobs, padded_batch, random_rollout

PROMPT_LENGTHS, RESPONSE_LENGTHS = [3, 6, 4, 1], [5, 2, 4, 5]


def _reference(model, batch, temperature: float) -> torch.Tensor:
    """fp32 [B, R]: each response token's log-prob from the wrapped bf16 model's logits, vLLM's recipe."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    width_p = batch["prompts"].shape[1]
    with torch.no_grad():
        if temperature == 1.0:
            scored = rl.logprobs(model, ids, mask)[:, width_p - 1:]
        else:
            logits_BLV = rl.wrap(model)(ids, attention_mask=mask).logits.float()
            log_softmax = mok.log_softmax(logits_BLV.flatten(0, 1) / torch.tensor([[temperature]]))
            picked = log_softmax.gather(1, ids.roll(-1, 1).flatten()[:, None]).view(ids.shape)
            scored = picked[:, width_p - 1: -1]
    return scored * batch["response_mask"]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_mok_engine_logprobs_are_the_reference_bits(mok_engine, bf16_model, temperature):
    batch = padded_batch(*random_rollout(0, PROMPT_LENGTHS, RESPONSE_LENGTHS))
    logprobs, _ = engine_logprobs(mok_engine, batch, temperature)
    reference = _reference(bf16_model, batch, temperature)
    assert logprobs.shape == (4, 5)
    assert int((logprobs != 0).sum()) == sum(RESPONSE_LENGTHS)  # every response token scored, padding 0.0
    assert torch.equal(logprobs, reference)


def test_text_batches_from_verls_agent_loop_carry_empty_multimodal_inputs(mok_engine):
    """verl's agent loop stores multi_modal_inputs = {} for every text sequence (its GPU run hit this): the same
    bits as without them; a sequence with an image input is refused by name."""
    from mok.errors import UnsupportedError

    batch = padded_batch(*random_rollout(3, PROMPT_LENGTHS, RESPONSE_LENGTHS))
    plain, _ = engine_logprobs(mok_engine, batch, 1.0)
    with_field, _ = engine_logprobs(mok_engine, batch, 1.0, multi_modal_inputs=[{} for _ in PROMPT_LENGTHS])
    assert torch.equal(plain, with_field)
    images = [{}, {"pixel_values": torch.ones(2, 3)}, {}, {}]
    with pytest.raises(UnsupportedError, match="multimodal inputs"):
        engine_logprobs(mok_engine, batch, 1.0, multi_modal_inputs=images)


def test_the_temperature_and_the_micro_batches(mok_engine):
    """A sequence's log-probs do not depend on its micro-batch (mok is batch-invariant); the temperature matters."""
    batch = padded_batch(*random_rollout(1, PROMPT_LENGTHS, RESPONSE_LENGTHS))
    one_at_a_time, _ = engine_logprobs(mok_engine, batch, 0.7, micro_batch=1)
    all_together, _ = engine_logprobs(mok_engine, batch, 0.7, micro_batch=4)
    assert torch.equal(one_at_a_time, all_together)
    assert not torch.equal(all_together, engine_logprobs(mok_engine, batch, 1.0)[0])


def test_entropy_is_verls_definition(mok_engine, bf16_model):
    """Entropy of the temperature-scaled distribution (verl's entropy_from_logits) at each scored position."""
    from verl.utils.torch_functional import entropy_from_logits

    batch = padded_batch(*random_rollout(2, PROMPT_LENGTHS, RESPONSE_LENGTHS))
    _, entropy = engine_logprobs(mok_engine, batch, 0.7)
    with torch.no_grad():
        logits = rl.wrap(bf16_model)(batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float() / 0.7
    width_p = batch["prompts"].shape[1]
    expected = entropy_from_logits(logits)[:, width_p - 1: -1] * batch["response_mask"]
    torch.testing.assert_close(entropy, expected, rtol=1e-5, atol=1e-5)
    assert bool((entropy[batch["response_mask"].bool()] > 0).all())


def test_verls_stock_engine_differs(mok_engine, stock_engine):
    """Negative control: verl's own engine (bf16 autocast over fp32 weights, torch's kernels) on the same
    checkpoint and batch does not give the mok bits."""
    batch = padded_batch(*random_rollout(0, PROMPT_LENGTHS, RESPONSE_LENGTHS))
    ours, _ = engine_logprobs(mok_engine, batch, 1.0)
    stock, _ = engine_logprobs(stock_engine, batch, 1.0)
    gap = (ours - stock).abs().max().item()
    assert gap > 1e-4, gap
    assert gap < 1.0, gap  # the same model: close, not equal


def test_a_training_step_moves_the_weights_verl_syncs_and_keeps_the_agreement(checkpoint):
    """verl's train_batch with verl's PPO loss through the mok engine: the loss backpropagates (FSDP2 reduces the
    gradients of the one group), the optimizer moves the weights, and the weights verl would send vLLM
    (get_per_tensor_param, cast to bf16 as vLLM loads them) give the engine's new log-probs bit for bit."""
    from functools import partial

    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding

    from rl.testing import tiny_model
    from rl.verl import MokFSDPEngineWithLMHead
    from tests.verl.conftest import build_engine

    engine = build_engine(MokFSDPEngineWithLMHead, checkpoint)
    batch = padded_batch(*random_rollout(3, PROMPT_LENGTHS, RESPONSE_LENGTHS))
    before, _ = engine_logprobs(engine, batch, 1.0)
    advantages = torch.linspace(-1.0, 1.0, 4)[:, None].expand_as(before).contiguous() * batch["response_mask"]
    data = TensorDict({**batch, "old_log_probs": before, "advantages": advantages}, batch_size=[4])
    data = left_right_2_no_padding(data)
    tu.assign_non_tensor(data, temperature=1.0, calculate_entropy=False, use_remove_padding=True,
                         use_dynamic_bsz=False, micro_batch_size_per_gpu=2, max_token_len_per_gpu=4096,
                         use_fused_kernels=False, global_batch_size=4)
    actor_config = FSDPActorConfig(strategy="fsdp2", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2,
                                   rollout_n=1)
    with engine.train_mode():
        output = engine.train_batch(data, loss_function=partial(ppo_loss, actor_config))
    assert output is not None
    after, _ = engine_logprobs(engine, batch, 1.0)
    assert not torch.equal(after, before)
    params, _ = engine.get_per_tensor_param()
    synced = tiny_model("qwen3_moe", seed=0)
    synced.load_state_dict(_fused_experts({name: tensor.to(torch.bfloat16) for name, tensor in params}))
    with torch.no_grad():
        reference = rl.logprobs(synced, batch["input_ids"], batch["attention_mask"])[:, batch["prompts"].shape[1] - 1:]
    assert torch.equal(after, reference * batch["response_mask"])


def _fused_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """verl's weight sync sends vLLM's per-expert keys (experts.{e}.gate_proj / up_proj / down_proj); transformers 5
    holds them fused: experts.gate_up_proj [E, 2I, H] (gates then ups), experts.down_proj [E, H, I]."""
    out, experts = {}, {}
    for name, tensor in state.items():
        head, sep, tail = name.partition(".mlp.experts.")
        if not sep:
            out[name] = tensor
            continue
        index, projection = tail.split(".")[:2]
        experts.setdefault(head, {}).setdefault(projection, {})[int(index)] = tensor
    for head, projections in experts.items():
        def stacked(kind):
            return torch.stack([projections[kind][e] for e in sorted(projections[kind])])

        out[f"{head}.mlp.experts.gate_up_proj"] = torch.cat([stacked("gate_proj"), stacked("up_proj")], dim=1)
        out[f"{head}.mlp.experts.down_proj"] = stacked("down_proj")
    return out
