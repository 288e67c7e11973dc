"""What the RL demo (examples/rl_demo.py) records and reports: each side's trace recorder (SideRecorder; BaselineTaps
for the plain transformers trainer of --baseline), the per-step agreement read back from the two traces, the run's
results and the summary table.

Shapes: docs/shapes.md.
"""
from __future__ import annotations

import json
import math
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from rl import trace_names

# -- recording -----------------------------------------------------------------------------------------

class SideRecorder:
    """A verify.Recorder for one side plus the observer that feeds it from mok.hooks.

    Besides every op mok emits, it records `layers.{i}.routes`: the router's input rows (input) and the
    experts each token is routed to (topk ids, int32, output), derived from the recorded router logits
    with mok.route (the one routing definition, docs/contracts.md, Routing), so routing agreement is
    read off the trace.
    """

    def __init__(self, path: Path, run: str, meta: dict, top_k: int, renormalize: bool):
        import verify

        self.recorder = verify.Recorder(path, run=run, meta=meta, overwrite=True)
        self.path = self.recorder.path
        self.top_k, self.renormalize = top_k, renormalize
        self._router_input: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, tensor: torch.Tensor, kind: str) -> None:
        tensor = tensor.detach()
        self.recorder.record(name, tensor, kind=kind)
        index, op = trace_names.split(name)
        if index is not None and op == trace_names.ROUTER:
            if kind == "input":
                self._router_input[index] = tensor
            elif kind == "output" and index in self._router_input:
                self.record_routes(index, self._router_input.pop(index), tensor)

    def record_routes(self, index: int, x_TH: torch.Tensor, router_logits_TE: torch.Tensor) -> None:
        import mok

        with torch.no_grad():
            ids_TK, _ = mok.route(router_logits_TE, self.top_k, self.renormalize)
        self.record_ids(index, x_TH, ids_TK)

    def record_ids(self, index: int, x_TH: torch.Tensor, ids_TK: torch.Tensor) -> None:
        name = trace_names.layer(index, trace_names.ROUTES)
        self.recorder.record(name, x_TH, kind="input")
        self.recorder.record(name, ids_TK.to(torch.int32), kind="output")

    def observing(self):
        from mok import hooks

        return hooks.observe(self)


class BaselineTaps:
    """Forward hooks on a plain transformers Qwen3-MoE that record the per-row ops of rl/trace_names.py
    (embed, layers.{i}.input_norm, .qkv, .o_proj, .post_attention_norm, .router, .routes, .moe,
    final_norm, lm_head) for the real (unpadded) tokens, so the baseline trainer can be content-aligned
    with the sampler like the wrapped one. The hooks record only inside `observing()` (like SideRecorder's)."""

    def __init__(self, model: torch.nn.Module, side: SideRecorder):
        self.side = side
        self.real_BL: torch.Tensor | None = None
        self.active = False
        self._qk: dict[int, list[torch.Tensor]] = {}
        self.handles = []
        inner = model.model
        names = trace_names
        self._tap(inner.embed_tokens, names.EMBED, inputs=False)
        for i, layer in enumerate(inner.layers):
            self._tap(layer.input_layernorm, names.layer(i, names.INPUT_NORM))
            self._tap(layer.self_attn.o_proj, names.layer(i, names.O_PROJ))
            self._tap(layer.post_attention_layernorm, names.layer(i, names.POST_ATTENTION_NORM))
            self._tap(layer.mlp, names.layer(i, names.MOE))
            self.handles.append(layer.mlp.gate.register_forward_hook(self._router_hook(i)))
            attn = layer.self_attn
            self.handles.append(attn.q_proj.register_forward_hook(self._stash(i)))
            self.handles.append(attn.k_proj.register_forward_hook(self._stash(i)))
            self.handles.append(attn.v_proj.register_forward_hook(self._qkv_hook(i)))
        self._tap(inner.norm, names.FINAL_NORM)
        self._tap(model.lm_head, names.LM_HEAD)

    @contextmanager
    def observing(self):
        self.active = True
        try:
            yield self
        finally:
            self.active, self._qk = False, {}

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """[B, S, ...] or [B*S, ...] -> the real tokens' rows [T, ...]."""
        real = self.real_BL.to(t.device)
        return t[real] if t.dim() >= 3 and t.shape[:2] == real.shape else t[real.reshape(-1)]

    def _tap(self, module, name: str, inputs: bool = True) -> None:
        def hook(mod, args, output):
            if not self.active:
                return
            if inputs:
                self.side.recorder.record(name, self.rows(args[0].detach()), kind="input")
            self.side.recorder.record(name, self.rows(output.detach()), kind="output")
        self.handles.append(module.register_forward_hook(hook))

    def _router_hook(self, index: int):
        def hook(mod, args, output):
            if not self.active:
                return
            logits, _scores, indices = output
            x = self.rows(args[0].detach().reshape(-1, args[0].shape[-1]))
            name = trace_names.layer(index, trace_names.ROUTER)
            self.side.recorder.record(name, x, kind="input")
            self.side.recorder.record(name, self.rows(logits.detach()), kind="output")
            self.side.record_ids(index, x, self.rows(indices))
        return hook

    def _stash(self, index: int):
        def hook(mod, args, output):
            if self.active:
                self._qk.setdefault(index, []).append(output.detach())
        return hook

    def _qkv_hook(self, index: int):
        def hook(mod, args, output):
            if not self.active:
                return
            q, k = self._qk.pop(index)
            name = trace_names.layer(index, trace_names.QKV)
            self.side.recorder.record(name, self.rows(args[0].detach()), kind="input")
            self.side.recorder.record(name, self.rows(torch.cat([q, k, output.detach()], dim=-1)), kind="output")
        return hook


# -- results and report ---------------------------------------------------------------------------------

@dataclass
class StepResult:
    step: int
    reward: float                 # mean reward of the step's B completions (sampled before its updates)
    loss: float                   # clipped surrogate at the step's last optimizer step; at the first, on-policy
                                  # one it is ~0 by construction (ratio 1, advantages centred per group)
    max_logprob_gap: float
    bitwise_equal_tokens: int
    tokens: int
    routing_agreement: float      # fraction of routed token rows (matched by content) with equal experts
    ops_agreeing: int             # (op, step) pairs whose matched rows all agree
    ops_compared: int
    digest: str
    seconds: float
    first_divergence: str | None = None


@dataclass
class DemoResult:
    out: str
    sampler: str
    trainer: str
    device: str
    steps: list[StepResult] = field(default_factory=list)
    trace_digest: str = ""
    sampler_digest: str = ""
    checkpoint: str = ""
    checkpoint_digest: str = ""
    report: str = ""
    first_divergence: str | None = None

    @property
    def bitwise(self) -> bool:
        return all(s.max_logprob_gap == 0 and s.routing_agreement == 1.0 and s.ops_agreeing == s.ops_compared
                   for s in self.steps)

    def to_json(self) -> dict:
        return {**asdict(self), "bitwise": self.bitwise}


ALIGNED_OPS = trace_names.per_row_globs(routes=True)
"""The ops both sides record per row (a row's output depends on its input row alone): content-aligned."""


def step_agreement(trainer_trace: Path, sampler_trace: Path, step: int, order: tuple[str, ...]):
    """(routing agreement, ops agreeing, ops compared, first divergence text) for one step, read back
    from the two traces with verify's content alignment of ALIGNED_OPS, in data-path `order`."""
    from verify.report import agreement_by_step, describe_content, first_content_divergence

    ops = agreement_by_step(trainer_trace, sampler_trace, ALIGNED_OPS, steps=[step], order=order)
    routes = [op for op in ops if trace_names.split(op.name)[1] == trace_names.ROUTES]
    matched = sum(op.matched for op in routes)
    routing = sum(op.agreeing for op in routes) / matched if matched else math.nan
    compared = [op for op in ops if op.matched]
    first = first_content_divergence(ops)
    text = None if first is None else describe_content(first)
    return routing, sum(op.ok for op in compared), len(compared), text


def xxhash_manifest(checkpoint: Path) -> str:
    """One digest of a checkpoint's tensors (names, dtypes, shapes, bits), via verify.hash_checkpoint."""
    import xxhash

    import verify

    manifest = verify.hash_checkpoint(checkpoint, progress=False)
    return xxhash.xxh3_64(json.dumps(manifest["tensors"], sort_keys=True).encode()).hexdigest()


def percent(fraction: float) -> str:
    """'100.0%', or 'n/a' when no row could be matched (the inputs already differ upstream)."""
    return "n/a" if math.isnan(fraction) else f"{100 * fraction:.1f}%"


def summary(result: DemoResult, baseline: bool) -> str:
    rows = [f"{'step':>4} {'reward':>7} {'loss':>10} {'max gap':>9} {'bitwise':>9} {'routing':>8} {'ops':>7}  digest"]
    for s in result.steps:
        rows.append(f"{s.step:>4} {s.reward:>7.3f} {s.loss:>+10.2e} {s.max_logprob_gap:>9.3g} "
                    f"{f'{s.bitwise_equal_tokens}/{s.tokens}':>9} {percent(s.routing_agreement):>8} "
                    f"{f'{s.ops_agreeing}/{s.ops_compared}':>7}  {s.digest}")
    out = Path(result.out)
    rows += [
        "",
        f"sampler {result.sampler}, trainer {result.trainer}, device {result.device}",
        f"trace digests: trainer {result.trace_digest}, sampler {result.sampler_digest}",
        f"checkpoint: {result.checkpoint} (digest {result.checkpoint_digest})",
        f"report: {result.report} (plots: {out / 'metrics.png'}, {out / 'agreement.png'})",
    ]
    if baseline:
        worst = max((s.max_logprob_gap for s in result.steps), default=0.0)
        rows.append(f"baseline: max |trainer - sampler| = {worst:.3g}; where it starts (content alignment, "
                    f"trainer.db vs sampler.db):")
        rows.append(f"  {result.first_divergence or 'no divergence found'}")
        rows.append(f"  mok-verify report {out / 'trainer.db'}    # the per-op heat map of the gap")
    else:
        verdict = "BITWISE IDENTICAL at every step" if result.bitwise else "NOT bitwise identical"
        rows.append(f"trainer vs sampler: {verdict}")
        rows.append(f"reproduce: rerun with --out OTHER, then mok-verify checkpoint {result.checkpoint} "
                    f"OTHER/checkpoint.safetensors")
    return "\n".join(rows)
