"""rl.wrap / rl.logprobs on tiny random models: same numbers as transformers (fp32, to rounding), same
bits whatever the padding or batch, parameters shared and trained, unsupported models refused."""
from __future__ import annotations

import pytest
import torch

import rl
from mok.errors import UnsupportedError
from rl.testing import ARCHITECTURES, tiny_model

ARCHS = ARCHITECTURES


def _reference_logprobs(logits_BLV: torch.Tensor, input_ids_BL: torch.Tensor) -> torch.Tensor:
    logprobs_BLV = torch.log_softmax(logits_BLV.double(), dim=-1)
    return logprobs_BLV[:, :-1].gather(-1, input_ids_BL[:, 1:, None])[..., 0]


@pytest.mark.parametrize("arch, overrides", [
    ("qwen3_moe", {}),
    ("qwen3_moe", {"mlp_only_layers": [1], "num_key_value_heads": 4}),  # a dense layer, no GQA
    ("mixtral", {}),
    ("olmoe", {"clip_qkv": 0.5}),
    ("qwen2_moe", {}),
])
def test_wrapped_forward_matches_transformers_in_fp32(arch, overrides):
    model = tiny_model(arch, seed=3, dtype=torch.float32, **overrides)
    input_ids = torch.randint(3, 512, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids).logits
        rl.wrap(model)
        got = model(input_ids).logits
        got_logprobs = rl.logprobs(model, input_ids)
    assert got.shape == expected.shape and got.dtype == torch.float32
    # Different summation orders and routing weights kept in fp32: equal to fp32 rounding, not bitwise.
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got_logprobs.double(), _reference_logprobs(expected, input_ids), atol=2e-5, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_padding_side_and_batch_do_not_change_bits(arch):
    model = rl.wrap(tiny_model(arch, seed=1))
    generator = torch.Generator().manual_seed(7)
    sequence = torch.randint(3, 512, (9,), generator=generator)
    others = torch.randint(3, 512, (4, 13), generator=generator)
    alone = rl.logprobs(model, sequence[None])[0]

    right = torch.zeros(5, 13, dtype=torch.int64)
    right_mask = torch.zeros(5, 13, dtype=torch.int64)
    right[:4], right_mask[:4] = others, 1
    right[4, :9], right_mask[4, :9] = sequence, 1
    left, left_mask = right.clone(), right_mask.clone()
    left[4], left_mask[4] = 0, 0
    left[4, 4:], left_mask[4, 4:] = sequence, 1

    with torch.no_grad():
        from_right = rl.logprobs(model, right, right_mask)
        from_left = rl.logprobs(model, left, left_mask)
        logits_alone = model(sequence[None]).logits[0]
        logits_right = model(right, attention_mask=right_mask).logits
    assert from_right.dtype == torch.float32 and from_right.shape == (5, 12)
    assert torch.equal(from_right[4, :8], alone)
    assert torch.equal(from_left[4, 4:], alone)
    assert torch.equal(from_right[4, 8:], torch.zeros(4))  # padding positions are 0
    assert torch.equal(from_left[4, :4], torch.zeros(4))
    assert torch.equal(logits_right[4, :9], logits_alone)
    assert torch.equal(logits_right[4, 9:], torch.zeros_like(logits_right[4, 9:]))
    assert bool((alone < 0).all())


def test_wrap_shares_parameters_and_keeps_the_model():
    model = tiny_model("qwen3_moe")
    before = {name: (p.data_ptr(), p.shape) for name, p in model.named_parameters()}
    keys = list(model.state_dict())
    assert rl.wrap(model) is model and rl.wrap(model) is model  # in place, idempotent
    assert {name: (p.data_ptr(), p.shape) for name, p in model.named_parameters()} == before
    assert list(model.state_dict()) == keys
    from rl.models import adapter_for

    moe = adapter_for(model).layers[0].mlp
    assert moe.experts.gate_up_proj is model.model.layers[0].mlp.experts.gate_up_proj
    assert moe.top_k == 2 and moe.renormalize is True
    assert type(model).__name__ == "Qwen3MoeForCausalLM"


def _grad_fingerprints(model, input_ids, attention_mask, completion_mask):
    from verify import fingerprint

    model.zero_grad(set_to_none=True)
    logprobs = rl.logprobs(model, input_ids, attention_mask)
    (-(logprobs * completion_mask).sum() / completion_mask.sum()).backward()
    return {name: fingerprint(p.grad) for name, p in model.named_parameters()}, logprobs.detach()


@pytest.mark.parametrize("arch", ARCHS)
def test_backward_is_deterministic_and_reaches_every_parameter(arch):
    model = rl.wrap(tiny_model(arch, seed=2))
    model.train()
    generator = torch.Generator().manual_seed(5)
    input_ids = torch.randint(3, 512, (3, 10), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 7:] = 0
    attention_mask[2, :3] = 0
    completion_mask = (attention_mask[:, 1:] * attention_mask[:, :-1]).float()

    first, logprobs = _grad_fingerprints(model, input_ids, attention_mask, completion_mask)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    second, _ = _grad_fingerprints(model, input_ids, attention_mask, completion_mask)
    assert first == second
    for name, grad in grads.items():
        assert torch.isfinite(grad).all(), name
        assert grad.abs().sum() > 0, f"{name} received no gradient"

    # One SGD step on the completion log-likelihood raises it.
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad
        after = rl.logprobs(model, input_ids, attention_mask)
    assert (after * completion_mask).sum() > (logprobs * completion_mask).sum()


def test_labels_give_the_mean_next_token_loss():
    model = rl.wrap(tiny_model("mixtral", dtype=torch.float32))
    input_ids = torch.randint(3, 512, (2, 8), generator=torch.Generator().manual_seed(0))
    labels = input_ids.clone()
    labels[0, 5:] = -100
    out = model(input_ids, labels=labels)
    logprobs = rl.logprobs(model, input_ids)
    keep = labels[:, 1:] != -100
    assert torch.equal(out.loss, -logprobs[keep].sum() / keep.sum())


@pytest.mark.parametrize("arch, overrides, message", [
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 16}, "sliding window"),
    ("mixtral", {"router_jitter_noise": 0.1}, "jitter"),
    ("qwen3_moe", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, "rope_type"),
])
def test_unsupported_configurations_are_named(arch, overrides, message):
    with pytest.raises(rl.UnsupportedModelError, match=message):
        rl.wrap(tiny_model(arch, **overrides))


def test_unsupported_architecture_is_named():
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config)
    with pytest.raises(rl.UnsupportedModelError, match="'llama'.*supported: qwen3_moe"):
        rl.wrap(model)
    with pytest.raises(UnsupportedError):
        rl.logprobs(model, torch.zeros(1, 3, dtype=torch.int64))


def test_bad_inputs_raise_typed_errors():
    model = rl.wrap(tiny_model("olmoe"))
    input_ids = torch.randint(3, 512, (2, 6))
    gap = torch.ones_like(input_ids)
    gap[0, 2] = 0
    with pytest.raises(UnsupportedError, match="contiguous"):
        rl.logprobs(model, input_ids, gap)
    with pytest.raises(UnsupportedError, match="attention_mask"):
        rl.logprobs(model, input_ids, torch.ones(2, 5))
    with pytest.raises(UnsupportedError, match="rl.generate"):
        model(input_ids, use_cache=True)
    with pytest.raises(UnsupportedError, match="at least one token"):
        rl.generate(model, [[4], []], max_new_tokens=2)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tiny_models_keep_rotary_frequencies_as_from_pretrained_does(arch):
    """A bf16 model from from_pretrained(dtype=...) keeps its rotary inv_freq fp32; the test models must too, or the
    transformers baseline rounds its frequencies and drifts from the model users load (tens of percent at 2k tokens
    of MLA)."""
    import transformers

    model = tiny_model(arch)
    loaded = transformers.AutoModelForCausalLM.from_config(model.config, dtype=torch.bfloat16)
    ours = {name: buffer for name, buffer in model.named_buffers() if name.endswith("inv_freq")}
    theirs = {name: buffer for name, buffer in loaded.named_buffers() if name.endswith("inv_freq")}
    assert ours.keys() == theirs.keys() and ours
    for name, buffer in ours.items():
        assert buffer.dtype == theirs[name].dtype == torch.float32, name
        assert torch.equal(buffer, theirs[name]), name


def test_the_tiny_checkpoints_tokenizer_maps_each_word_to_its_id(tmp_path):
    """'t<i>' -> i for every word, the special words included and never splitting others ('t218' is not 't2' '18')."""
    from transformers import AutoTokenizer

    from rl.testing import save_tiny_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(save_tiny_checkpoint("qwen3_moe", tmp_path))
    ids = list(range(tokenizer.vocab_size))
    assert tokenizer.encode(" ".join(f"t{i}" for i in ids), add_special_tokens=False) == ids
    specials = tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id
    assert specials == (0, 1, 2, 3)
    assert tokenizer.decode([218, 2, 391]) == "t218 t2 t391"
