"""verl's batches, built the way verl's trainer builds them: left-padded prompts, right-padded responses, then
verl's own left_right_2_no_padding / no_padding_2_padding around the engine call (the steps of
RayPPOTrainer._compute_old_log_prob, which needs a Ray worker group to call)."""
from __future__ import annotations

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding


def padded_batch(prompts: list[list[int]], responses: list[list[int]]) -> dict[str, torch.Tensor]:
    """verl's padded rollout batch: prompts [B, P] (left-padded), responses [B, R] (right-padded), input_ids,
    attention_mask, position_ids [B, P+R], response_mask [B, R] (int64, pad id 0)."""
    batch, width_p, width_r = len(prompts), max(map(len, prompts)), max(map(len, responses))
    prompt_ids = torch.zeros(batch, width_p, dtype=torch.int64)
    response_ids = torch.zeros(batch, width_r, dtype=torch.int64)
    mask = torch.zeros(batch, width_p + width_r, dtype=torch.int64)
    for b, (prompt, response) in enumerate(zip(prompts, responses)):
        prompt_ids[b, width_p - len(prompt):] = torch.tensor(prompt)
        response_ids[b, :len(response)] = torch.tensor(response, dtype=torch.int64)
        mask[b, width_p - len(prompt): width_p + len(response)] = 1
    return {"prompts": prompt_ids, "responses": response_ids, "input_ids": torch.cat([prompt_ids, response_ids], 1),
            "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
            "response_mask": mask[:, width_p:]}


def engine_logprobs(engine, batch: dict[str, torch.Tensor], temperature: float, micro_batch: int = 2,
                    multi_modal_inputs: list[dict] | None = None, **settings) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_probs fp32 [B, R], entropy fp32 [B, R]) of the responses from verl's engine.infer_batch, padded back
    by verl's no_padding_2_padding, as the trainer's old log-probs are. multi_modal_inputs: one dict per sequence,
    stored as verl's agent loop stores them (tu.get_tensordict; {} for a text sequence)."""
    if multi_modal_inputs is None:
        data = TensorDict(dict(batch), batch_size=[batch["input_ids"].shape[0]])
    else:
        data = tu.get_tensordict({**batch, "multi_modal_inputs": multi_modal_inputs})
    data = left_right_2_no_padding(data)
    tu.assign_non_tensor(data, temperature=temperature, calculate_entropy=True, compute_loss=False,
                         use_remove_padding=True, use_dynamic_bsz=False, micro_batch_size_per_gpu=micro_batch,
                         max_token_len_per_gpu=4096, use_fused_kernels=False, **settings)
    with engine.eval_mode():
        output = engine.infer_batch(data, loss_function=None)
    model_output = output["model_output"]
    return (no_padding_2_padding(model_output["log_probs"], data).float(),
            no_padding_2_padding(model_output["entropy"], data).float())


def random_rollout(seed: int, prompt_lengths: list[int], response_lengths: list[int], vocab: int = 512):
    """Random prompts and responses (token ids 3..vocab-1) of the given lengths."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in prompt_lengths]
    responses = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in response_lengths]
    return prompts, responses
