"""The names of traced ops and their order: the one contract between the trainer, the sampler and a trace reader.

Both sides name the same ops the same way, so two traces (trainer and sampler) line up op by op:

    embed
    layers.{i}.input_norm           (the RMSNorm before attention; records the row it normalizes)
    layers.{i}.qkv                  (q, k and v projections concatenated, like vLLM's fused qkv_proj)
    layers.{i}.attention            (output only: not a per-row op)
    layers.{i}.o_proj
    layers.{i}.post_attention_norm
    layers.{i}.router               (the router gate's logits [T, E])
    layers.{i}.moe
    final_norm
    lm_head
    logprobs                        (not a per-row op: a row's value depends on its target token too)

`layers.{i}.routes` is not an op: a recorder may derive it from `router`'s output with mok.route (the
experts of each token, keyed by the router's input rows; examples/rl_demo.py does); its place is right
after `router`. Ops without a name here (q/k norms, rotary, shared experts, dense MLPs) are not traced,
so every side records the same set. Users: rl/models/decoder.py (trainer and rl.generate), rl/vllm/
(the sampler plugin, which also maps vLLM's module paths here), examples/rl_demo.py, and the callers of
verify's reports, which take the names and their order as parameters (verify knows no name of rl).
"""
from __future__ import annotations

EMBED = "embed"
INPUT_NORM = "input_norm"
QKV = "qkv"
ATTENTION = "attention"
O_PROJ = "o_proj"
POST_ATTENTION_NORM = "post_attention_norm"
ROUTER = "router"
ROUTES = "routes"
MOE = "moe"
FINAL_NORM = "final_norm"
LM_HEAD = "lm_head"
LOGPROBS = "logprobs"

LAYER_OPS: tuple[str, ...] = (INPUT_NORM, QKV, ATTENTION, O_PROJ, POST_ATTENTION_NORM, ROUTER, MOE)
"""The traced ops of one decoder layer, in execution order (a dense layer has no router and moe)."""

NOT_PER_ROW: frozenset[str] = frozenset({ATTENTION, LOGPROBS})
"""Ops whose output row depends on more than its own input row: content alignment leaves them out."""

_PREFIX = "layers."


def layer(index: int, op: str) -> str:
    """(3, 'moe') -> 'layers.3.moe'."""
    return f"{_PREFIX}{index}.{op}"


def split(name: str) -> tuple[int | None, str]:
    """'layers.3.moe' -> (3, 'moe'); a name outside the layers -> (None, name)."""
    if name.startswith(_PREFIX):
        index, _, op = name[len(_PREFIX):].partition(".")
        if index.isdigit() and op:
            return int(index), op
    return None, name


def layer_ops(routes: bool = False) -> tuple[str, ...]:
    """LAYER_OPS, with `routes` right after `router` when a recorder derives it."""
    if not routes:
        return LAYER_OPS
    at = LAYER_OPS.index(ROUTER) + 1
    return (*LAYER_OPS[:at], ROUTES, *LAYER_OPS[at:])


def in_order(num_layers: int, routes: bool = False, per_row: bool = False) -> tuple[str, ...]:
    """Every traced name of a model with `num_layers` decoder layers, in data-path order.

    routes: include the derived `layers.{i}.routes`; per_row: only the ops content alignment compares.
    """
    keep = (lambda op: op not in NOT_PER_ROW) if per_row else (lambda op: True)
    inside = [layer(i, op) for i in range(num_layers) for op in layer_ops(routes) if keep(op)]
    return tuple(name for name in (EMBED, *inside, FINAL_NORM, LM_HEAD, LOGPROBS) if keep(split(name)[1]))


def per_row_globs(routes: bool = False) -> tuple[str, ...]:
    """Globs of the per-row ops (a row's output depends on that row's input alone), in data-path order:
    what verify's content alignment (`--align content`, reports) should compare."""
    inside = tuple(f"{_PREFIX}*.{op}" for op in layer_ops(routes) if op not in NOT_PER_ROW)
    return (EMBED, *inside, FINAL_NORM, LM_HEAD)


# vLLM's module paths ('model.layers.3.self_attn.qkv_proj'; the checkpoint names of the supported
# architectures) -> trace names. The last component names the op; inside a layer it needs 'layers.<i>'.
_VLLM_LAYER_MODULES = {
    "input_layernorm": INPUT_NORM,
    "qkv_proj": QKV,
    "attn": ATTENTION,
    "o_proj": O_PROJ,
    "post_attention_layernorm": POST_ATTENTION_NORM,
    "gate": ROUTER,
    "experts": MOE,
}
_VLLM_MODEL_MODULES = {"embed_tokens": EMBED, "norm": FINAL_NORM, "lm_head": LM_HEAD}


def layer_index(path: str) -> int | None:
    """The decoder layer of a module path: 'model.layers.3.mlp.experts' -> 3; outside the layers -> None."""
    parts = path.split(".")
    for before, part in zip(parts, parts[1:]):
        if before == "layers" and part.isdigit():
            return int(part)
    return None


def from_vllm_module(path: str) -> str | None:
    """The trace name of the vLLM module at `path`, or None for a module that is not traced.

    'model.layers.3.self_attn.qkv_proj' -> 'layers.3.qkv', 'model.layers.0.input_layernorm' ->
    'layers.0.input_norm', 'model.layers.2.mlp.experts' -> 'layers.2.moe', 'model.norm' -> 'final_norm';
    q/k norms, gate_up_proj, down_proj, shared experts -> None.
    """
    last = path.rsplit(".", 1)[-1]
    index = layer_index(path)
    if index is None:
        return _VLLM_MODEL_MODULES.get(last)
    op = _VLLM_LAYER_MODULES.get(last)
    return None if op is None else layer(index, op)
