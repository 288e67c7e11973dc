"""rl: the two users of mok's ops: a training wrapper for transformers models and a vLLM sampling hook.

    import rl
    model = rl.wrap(transformers.AutoModelForCausalLM.from_pretrained(path))  # forward through mok
    out = rl.generate(model, prompts, max_new_tokens=32, temperature=1.0, seed=0)  # tokens + logprobs
    input_ids, attention_mask, completion = out.padded()
    logprobs = rl.logprobs(model, input_ids, attention_mask)  # fp32 [B, L-1], differentiable
    assert torch.equal(logprobs[completion], torch.cat(out.logprobs))  # bitwise
    rl.check_contract(rl.contract(model), sampler_contract)  # same versions, device, kernels, model numbers

Errors (rl/errors.py; all are mok.MokError, the first two also mok.UnsupportedError / ValueError):
`rl.UnsupportedModelError` (the model or a config field's value: mok does not implement it; parameters
on the meta device), `rl.InputError` (token ids outside the vocabulary, a mask with gaps, wrong shapes,
refused arguments), `rl.ContractMismatchError` (trainer and sampler contracts differ; `.differences`).
Empty inputs are not errors: B = 0, L = 0 or an all-padding batch give empty / all-zero results.

The functions share their names with their modules (rl/wrap.py, ...): importing them here, eagerly,
keeps `rl.wrap` the function even after `import rl.wrap` elsewhere. Importing `rl` costs torch and
mok's error/hook modules only (transformers and the op implementations load on first use).
"""
from rl.contract import check_contract, contract
from rl.errors import ContractMismatchError, InputError, UnsupportedModelError
from rl.generate import Generation, generate
from rl.logprobs import logprobs
from rl.wrap import wrap

__all__ = ["wrap", "logprobs", "generate", "Generation", "contract", "check_contract", "UnsupportedModelError",
           "InputError", "ContractMismatchError"]
