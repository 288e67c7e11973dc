"""rl.verl: verl's PPO/GRPO trainer with mok on both sides, so the actor and vLLM compute the same bits.

Two lines for a verl user (verl 0.9, FSDP2 actor, vLLM rollout; `pip install -e ".[verl]"`):

    python -m rl.verl [verl's hydra overrides]   # instead of `python -m verl.trainer.main_ppo`; same config
    config = rl.verl.configure(config)           # or this, before `run_ppo(config, ...)` in your own launcher

What `configure` changes, through verl's own extension points (nothing of verl or vLLM is patched):
- the trainer side: `actor_rollout_ref.model.external_lib` gains "rl.verl", which verl imports in every
  worker that builds the model; importing it registers `MokFSDPEngineWithLMHead` (rl/verl/engine.py) in
  verl's EngineRegistry for (language_model, fsdp/fsdp2, cuda, nvidia), a key looked up before verl's own
  FSDP engine. It computes every log-probability verl asks the engine for (old policy, reference policy,
  the policy being trained; entropy when asked) through mok's decoder, with verl's temperature applied as
  vLLM's sampler applies it (fp32 logits divided by a fp32 temperature, then mok's log-softmax);
- the rollout side: MOK_VLLM=1 joins the Ray job's runtime environment, which verl's vLLM server actors
  inherit, so their engines run the mok plugin (verl's processed_logprobs mode included). Weight sync is
  verl's own, untouched.

Switch off what `check_config` refuses (UnsupportedError naming the full key, before Ray starts): a rollout other
than vLLM, rollout tensor or pipeline parallelism > 1, top_k, top_p < 1, min_p, repetition_penalty != 1,
do_sample=False, a temperature below 1e-5 or not finite, a logprobs_mode other than processed_logprobs,
quantization, a vLLM engine_kwargs model_impl or kv_cache_dtype other than the default; for the actor and the
reference policy: a strategy other than fsdp2, Ulysses sequence parallelism, fused kernels, Liger, LoRA, activation
offload, calculate_sum_pi_squared, an fp16 param_dtype. Remove-padding on or off and dynamic batch sizes are fine
(mok packs sequences itself; it is batch-invariant). The execution contracts of the actor and the reference policy
are compared with the rollout's as configured (`rl.ContractMismatchError` naming what differs, e.g. `dtype` when
the FSDP2 mixed-precision param_dtype is not the rollout's dtype); their runtime part (versions, device, kernels)
is the driver's for every side (verl's hybrid engine runs the rollout on the actor's GPUs, in its image), not
fetched from the servers. The engine refuses per-batch modes it does not compute (fused kernels, top-k
distillation, sum of squared probabilities, multimodal inputs, mrope, positions other than 0..n-1 per sequence).

Then verl's own `training/rollout_probs_diff_max` (exp(old_log_probs) vs exp(rollout_log_probs)) reads
exactly 0.0, and its rollout-correction weights are exactly 1 (examples/verl_grpo.py, on a GPU).
"""
from rl.verl.engine import MokFSDPEngineWithLMHead, register, sequence_logprobs
from rl.verl.settings import (
    TESTED_VERL,
    check_config,
    check_configured_contracts,
    check_verl_version,
    configure,
    configured_contracts,
    main,
)

register()

__all__ = ["configure", "check_config", "check_configured_contracts", "configured_contracts", "check_verl_version",
           "sequence_logprobs", "MokFSDPEngineWithLMHead", "main", "TESTED_VERL"]
