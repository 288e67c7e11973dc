"""Bad or degenerate inputs to rl.logprobs / the wrapped forward / rl.generate: a typed error
(rl.InputError, rl.UnsupportedModelError) or an empty result, never a raw torch exception."""
from __future__ import annotations

import pytest
import torch

import mok
import rl
from rl.testing import tiny_model


@pytest.fixture(scope="module")
def model():
    return rl.wrap(tiny_model("qwen3_moe", seed=0))


def _forward(model, input_ids, attention_mask=None):
    return model(input_ids, attention_mask=attention_mask).logits


@pytest.mark.parametrize("entry", [rl.logprobs, _forward])
@pytest.mark.parametrize("bad_id", [512, 100_000, -1])
def test_out_of_vocabulary_ids_are_input_errors(model, entry, bad_id):
    input_ids = torch.randint(3, 512, (2, 5), generator=torch.Generator().manual_seed(0))
    input_ids[1, 3] = bad_id
    with pytest.raises(rl.InputError, match=rf"token id {bad_id} is outside the vocabulary \[0, 512\)"):
        entry(model, input_ids)


def test_out_of_vocabulary_ids_at_padding_are_ignored(model):
    input_ids = torch.randint(3, 512, (2, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(input_ids)
    mask[1, 3:] = 0
    padded = input_ids.clone()
    padded[1, 3:] = -100  # a pad id that is not a token: never embedded
    assert torch.equal(rl.logprobs(model, padded, mask), rl.logprobs(model, input_ids, mask))


def test_generate_refuses_out_of_vocabulary_and_non_int_prompts(model):
    with pytest.raises(rl.InputError, match="vocabulary|\\[0, 512\\)"):
        rl.generate(model, [[5, 512]], max_new_tokens=1)
    with pytest.raises(rl.InputError, match="integers"):
        rl.generate(model, [[5, 6.0]], max_new_tokens=1)
    with pytest.raises(rl.InputError, match="integers"):
        rl.generate(model, [[5, "6"]], max_new_tokens=1)
    for flag in (True, torch.tensor(False)):  # operator.index would make them 1 and 0
        with pytest.raises(rl.InputError, match="is a bool"):
            rl.generate(model, [[5, flag]], max_new_tokens=1)
    assert rl.generate(model, [(5, torch.tensor(6))], max_new_tokens=1).prompts == [[5, 6]]  # index-able ints
    with pytest.raises(rl.InputError, match="list"):
        rl.generate(model, torch.tensor([[5, 6]]), max_new_tokens=1)


@pytest.mark.parametrize("shape", [(0, 6), (3, 0), (0, 0)])
def test_empty_batches_give_empty_results(model, shape):
    input_ids = torch.zeros(shape, dtype=torch.int64)
    logprobs = rl.logprobs(model, input_ids)
    assert logprobs.shape == (shape[0], max(shape[1] - 1, 0)) and logprobs.dtype == torch.float32
    out = model(input_ids, labels=input_ids)
    assert out.logits.shape == (*shape, 512)
    assert out.loss.item() == 0.0


def test_all_padding_batch_gives_zeros_and_a_backward(model):
    input_ids = torch.randint(3, 512, (2, 5))
    mask = torch.zeros_like(input_ids)
    logprobs = rl.logprobs(model, input_ids, mask)
    assert torch.equal(logprobs, torch.zeros(2, 4))
    logits = _forward(model, input_ids, mask)
    assert torch.equal(logits, torch.zeros(2, 5, 512, dtype=logits.dtype))
    model.zero_grad(set_to_none=True)
    logprobs.sum().backward()  # a step of only padding does not break the training loop
    assert torch.equal(model.lm_head.weight.grad, torch.zeros_like(model.lm_head.weight))


def test_all_padding_rows_beside_real_rows_keep_their_bits(model):
    input_ids = torch.randint(3, 512, (3, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(input_ids)
    mask[1] = 0
    both = rl.logprobs(model, input_ids, mask)
    assert torch.equal(both[1], torch.zeros(5))
    assert torch.equal(both[0], rl.logprobs(model, input_ids[:1])[0])
    assert torch.equal(both[2], rl.logprobs(model, input_ids[2:])[0])


def test_generate_with_no_prompts_is_empty(model):
    out = rl.generate(model, [], max_new_tokens=3)
    assert out.prompts == [] and out.tokens == [] and out.logprobs == []


@pytest.mark.parametrize("entry", ["logprobs", "forward", "generate"])
def test_meta_device_model_is_refused(entry):
    import transformers

    from rl.testing import tiny_config

    with torch.device("meta"):
        model = transformers.OlmoeForCausalLM(tiny_config("olmoe"))
    rl.wrap(model)  # wrapping a meta model is fine: weights are read at every forward
    input_ids = torch.randint(3, 512, (1, 4))
    with pytest.raises(rl.UnsupportedModelError, match="meta device"):
        if entry == "logprobs":
            rl.logprobs(model, input_ids)
        elif entry == "forward":
            model(input_ids)
        else:
            rl.generate(model, [[4, 5]], max_new_tokens=1)


def test_meta_model_materialised_after_wrap_runs():
    import transformers

    from rl.testing import tiny_config

    reference = tiny_model("olmoe", seed=5)
    with torch.device("meta"):
        model = transformers.OlmoeForCausalLM(tiny_config("olmoe"))
    rl.wrap(model)
    model.to_empty(device="cpu")
    model.load_state_dict(reference.state_dict())
    model.to(torch.bfloat16)
    input_ids = torch.randint(3, 512, (1, 6), generator=torch.Generator().manual_seed(0))
    assert torch.equal(rl.logprobs(model, input_ids), rl.logprobs(reference, input_ids))


@pytest.mark.parametrize("mask_row", [[1, 0, 1, 1, 1], [1, 1, 0, 0, 1], [0, 1, 0, 1, 0]])
@pytest.mark.parametrize("entry", [rl.logprobs, _forward])
def test_non_contiguous_padding_is_an_input_error(model, entry, mask_row):
    input_ids = torch.randint(3, 512, (2, 5))
    mask = torch.ones_like(input_ids)
    mask[1] = torch.tensor(mask_row)
    with pytest.raises(rl.InputError, match="row 1 has gaps"):
        entry(model, input_ids, mask)


@pytest.mark.parametrize("call, message", [
    (lambda m: rl.logprobs(m, torch.ones(4, dtype=torch.int64)), "integer tensor \\[batch, seq\\]"),
    (lambda m: rl.logprobs(m, torch.ones(1, 4)), "integer tensor"),
    (lambda m: rl.logprobs(m, [[1, 2, 3]]), "torch.Tensor"),
    (lambda m: rl.logprobs(m, torch.ones(1, 4, dtype=torch.int64), [[1, 1, 1, 1]]), "torch.Tensor"),
    (lambda m: rl.logprobs(m, torch.ones(1, 4, dtype=torch.int64), torch.ones(1, 3)), "attention_mask"),
    (lambda m: m(torch.ones(1, 4, dtype=torch.int64), labels=torch.ones(1, 3, dtype=torch.int64)), "labels"),
    (lambda m: m(torch.ones(1, 4, dtype=torch.int64), output_router_logits=True), "output_router_logits"),
    (lambda m: m(torch.ones(1, 4, dtype=torch.int64), position_ids=torch.arange(4)[None]), "position_ids"),
    (lambda m: m(None), "input_ids are required"),
])
def test_bad_arguments_are_input_errors(model, call, message):
    with pytest.raises(rl.InputError, match=message) as caught:
        call(model)
    assert isinstance(caught.value, mok.MokError) and isinstance(caught.value, mok.errors.UnsupportedError)


@pytest.mark.parametrize("kwargs, message", [
    ({"foo_bar": 1}, "does not take foo_bar=1"),
    ({"output_hidden_states": True}, "does not take output_hidden_states=True"),
    ({"return_dict": False}, "return_dict=False"),
    ({"labels": "float"}, "labels must be an integer tensor"),
    ({"labels": "out of vocabulary"}, r"labels must lie in \[0, 512\)"),
    ({"logits_to_keep": -1}, "logits_to_keep"),
    ({"logits_to_keep": torch.tensor([[1]])}, "logits_to_keep"),
])
def test_keywords_the_wrapped_forward_does_not_implement_are_refused(model, kwargs, message):
    input_ids = torch.randint(3, 512, (2, 5), generator=torch.Generator().manual_seed(0))
    labels = {"float": input_ids.float(), "out of vocabulary": input_ids.clone().index_fill_(1, torch.tensor([3]), 600)}
    kwargs = {k: labels.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()}
    with pytest.raises(rl.InputError, match=message):
        model(input_ids, **kwargs)
    model(input_ids, output_attentions=False, output_hidden_states=None, return_dict=True)  # switched off: fine


def test_the_wrapped_forward_keeps_logits_and_scales_the_loss_as_transformers_does():
    plain = tiny_model("qwen3_moe", seed=0, dtype=torch.float32)
    wrapped = rl.wrap(tiny_model("qwen3_moe", seed=0, dtype=torch.float32))
    input_ids = torch.randint(3, 512, (2, 7), generator=torch.Generator().manual_seed(1))
    labels = input_ids.clone()
    labels[0, :3] = -100
    for keep in (0, 2, torch.tensor([1, 4]), torch.tensor([6, 0, 6])):  # transformers' int and tensor forms
        want = plain(input_ids, logits_to_keep=keep).logits
        got = wrapped(input_ids, logits_to_keep=keep).logits
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-4), keep
    for items in (None, 40, torch.tensor(40)):  # gradient accumulation: sum / num_items_in_batch
        want = plain(input_ids, labels=labels, num_items_in_batch=items).loss
        got = wrapped(input_ids, labels=labels, num_items_in_batch=items).loss
        assert torch.allclose(got, want, rtol=1e-4), (items, got, want)


def test_a_module_replaced_after_wrapping_is_refused_until_wrapped_again():
    model = rl.wrap(tiny_model("qwen3_moe", seed=0, dtype=torch.float32))
    input_ids = torch.randint(3, 512, (1, 5), generator=torch.Generator().manual_seed(0))
    model.resize_token_embeddings(600, mean_resizing=False)  # a new lm_head module
    with pytest.raises(rl.UnsupportedModelError, match="lm_head is no longer the module rl.wrap read"):
        model(input_ids)
    with pytest.raises(rl.UnsupportedModelError, match="lm_head"):
        rl.logprobs(model, input_ids)
    assert rl.wrap(model)(input_ids).logits.shape[-1] == 600
    layer = model.model.layers[1].self_attn
    layer.q_proj = torch.nn.Linear(layer.q_proj.in_features, layer.q_proj.out_features, bias=False)
    with pytest.raises(rl.UnsupportedModelError, match=r"model\.layers\.1\.self_attn\.q_proj"):
        model(input_ids)


def test_a_float64_model_is_refused_at_wrap_naming_a_parameter():
    model = tiny_model("mixtral", seed=0, dtype=torch.float32).double()
    with pytest.raises(rl.UnsupportedModelError, match=r"model\.embed_tokens\.weight is torch\.float64"):
        rl.wrap(model)
