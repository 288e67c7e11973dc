"""The settings of the vLLM hook, read from the environment (vLLM's processes inherit it)."""
from __future__ import annotations

import os

from mok.errors import UnsupportedError

ENABLE_ENV = "MOK_VLLM"
OPS_ENV = "MOK_VLLM_OPS"
SKIP_ENV = "MOK_VLLM_SKIP"
TRACE_ENV = "MOK_TRACE"
TRACE_EVERY_ENV = "MOK_TRACE_EVERY"
TRACE_ROW_EVERY_ENV = "MOK_TRACE_ROW_EVERY"
TRACE_NAMES_ENV = "MOK_TRACE_NAMES"
TRACE_RING_ENV = "MOK_TRACE_RING"
TRACE_BACKGROUND_ENV = "MOK_TRACE_BACKGROUND"
PLUGIN_NAME = "mok"

OPS: tuple[str, ...] = (
    "moe",         # router gate (mok.linear) + mok.route + mok.moe in every unquantized MoE layer
    "embedding",   # input embedding (a row gather, traced as `embed`)
    "rms_norm",    # RMSNorm, with and without the fused residual add (mok.rms_norm)
    "linear",      # QKV, output, dense MLP and other unquantized linears (mok.linear)
    "rotary",      # rotary position embedding (mok.rotary)
    "silu_and_mul",  # SwiGLU activation of dense MLPs (mok.silu_and_mul)
    "attention",   # the attention backend: KV-cache write + mok.attention (CPU) or mok.paged_attention (CUDA)
    "lm_head",     # the logits (mok.linear, bf16 like the trainer)
    "logprobs",    # log-probabilities of sampled and prompt tokens (mok.log_softmax)
)
"""Everything between token ids and log-probabilities that mok can take over, in data-path order."""

OBSERVABLE_OPS = frozenset({"rms_norm", "linear", "lm_head", "attention"})
"""Ops that, when left to vLLM (MOK_VLLM_SKIP) while tracing, are still recorded under their trace names."""


def enabled() -> bool:
    """True when the hook is switched on: MOK_VLLM=1, or the plugin named in VLLM_PLUGINS."""
    flag = os.environ.get(ENABLE_ENV, "").strip().lower()
    if flag in ("1", "true", "yes", "on"):
        return True
    if flag not in ("", "0", "false", "no", "off"):  # a typo must not quietly sample with vLLM's own ops
        raise UnsupportedError(f"{ENABLE_ENV}={os.environ[ENABLE_ENV]!r}: expected 1 (on) or 0 (off)")
    plugins = os.environ.get("VLLM_PLUGINS")
    return plugins is not None and PLUGIN_NAME in [p.strip() for p in plugins.split(",")]


def _parse(value: str, env: str) -> set[str]:
    names = {part.strip() for part in value.split(",") if part.strip()}
    if "all" in names:
        names = (names - {"all"}) | set(OPS)
    unknown = sorted(names - set(OPS))
    if unknown:
        raise UnsupportedError(f"{env}: unknown op(s) {', '.join(unknown)}; choose from all, {', '.join(OPS)}")
    return names


def selected_ops() -> frozenset[str]:
    """The ops mok takes over: MOK_VLLM_OPS (default all) minus MOK_VLLM_SKIP."""
    chosen = _parse(os.environ.get(OPS_ENV, "").strip(" ,") or "all", OPS_ENV)  # blank: unset, as elsewhere
    chosen -= skipped_ops()
    return frozenset(chosen)


def skipped_ops() -> frozenset[str]:
    """MOK_VLLM_SKIP: ops left to vLLM on purpose. With MOK_TRACE they are still recorded under their
    trace names (vLLM computes, mok observes), so a trace diff names the op that diverges."""
    return frozenset(_parse(os.environ.get(SKIP_ENV, ""), SKIP_ENV))


def trace_base() -> str | None:
    """MOK_TRACE, or None when the sampler does not record."""
    value = os.environ.get(TRACE_ENV, "").strip()
    return value or None


def _int_env(env: str, minimum: int, meaning: str) -> int | None:
    """The integer >= minimum that `env` holds, or None where it is unset or blank."""
    value = os.environ.get(env, "").strip()
    if not value:
        return None
    if not (value.isascii() and value.isdigit() and int(value) >= minimum):
        raise UnsupportedError(f"{env}={value!r}: expected an integer >= {minimum} ({meaning})")
    return int(value)


def trace_rate() -> dict:
    """The trace's rate (verify/sampling.py) as verify.Recorder's keywords: MOK_TRACE_EVERY=N records every
    Nth forward (default 1), MOK_TRACE_ROW_EVERY=M keeps the row digests of about 1 row in M, by content,
    MOK_TRACE_NAMES=GLOB,GLOB records only the traced names (rl/trace_names.py) that match one (default: all;
    `layers.*.input_norm,lm_head,logprobs` is the light set: each layer's residual stream). A glob that matches no
    traced name is refused (UnsupportedError)."""
    return {"every": _int_env(TRACE_EVERY_ENV, 1, "1 = every one") or 1,
            "row_every": _int_env(TRACE_ROW_EVERY_ENV, 1, "1 = every one") or 1,
            "names": _trace_names()}


def _trace_names() -> list[str] | None:
    import fnmatch

    from rl import trace_names

    value = os.environ.get(TRACE_NAMES_ENV, "").strip()
    if not value:
        return None
    globs = [glob.strip() for glob in value.split(",")]
    known = trace_names.in_order(1024, routes=True)  # any layer index a model has
    for glob in globs:
        if not glob or not any(fnmatch.fnmatchcase(name, glob) for name in known):
            raise UnsupportedError(f"{TRACE_NAMES_ENV}={value!r}: {glob!r} matches no traced name (rl/trace_names.py: "
                                   "embed, layers.<i>.<op>, final_norm, lm_head, logprobs)")
    return globs


def trace_background() -> bool:
    """MOK_TRACE_BACKGROUND=1: each worker's trace is written by a writer process (verify.Recorder(background=True)),
    so a recorded forward waits neither for the device nor for SQLite; unset or 0: the forward that ends a step writes
    it (rl/vllm/trace.py says what each gives)."""
    value = os.environ.get(TRACE_BACKGROUND_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise UnsupportedError(f"{TRACE_BACKGROUND_ENV}={value!r}: expected 1 (write from a writer process) or 0")
    return value == "1"


def trace_ring() -> int | None:
    """MOK_TRACE_RING=N: the entries (int64) of each worker's capture ring, what one forward may record
    (verify/capture.py); unset: sized from the engine's max_num_batched_tokens and layers (rl/vllm/trace.py,
    engine_ring_entries), at least verify.capture.DEFAULT_CAPACITY."""
    return _int_env(TRACE_RING_ENV, 16, "ring entries")
