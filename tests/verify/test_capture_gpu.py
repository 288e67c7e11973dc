"""A DeviceTap on CUDA (verify/capture.py): mok's ops observed inside a CUDA graph and inside torch.compile record
the same trace as the eager Recorder on the same inputs; an overflow inside a graph is seen on the host."""
from __future__ import annotations

import pytest
import torch

import mok
from mok import hooks

pytestmark = pytest.mark.gpu

HIDDEN, INTER, EXPERTS, TOP_K = 512, 256, 16, 4


def _weights():
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    return dict(norm_F=randn(HIDDEN, scale=1.0) + 1, router_EF=randn(EXPERTS, HIDDEN, scale=HIDDEN ** -0.5),
                w13=randn(EXPERTS, 2 * INTER, HIDDEN, scale=HIDDEN ** -0.5),
                w2=randn(EXPERTS, HIDDEN, INTER, scale=INTER ** -0.5))


def _layer(x_TF, w):
    y_TF = mok.rms_norm(x_TF, w["norm_F"], 1e-6, name="layer.norm")
    logits_TE = mok.linear(y_TF, w["router_EF"], name="layer.router")
    return mok.moe(y_TF, logits_TE, w["w13"], w["w2"], TOP_K, name="layer.moe")


def _inputs(tokens, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(tokens, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)


def _records(path):
    from verify.store import Trace

    with Trace(path) as trace:
        return [(r.step, r.seq, r.name, r.kind, r.dtype, tuple(r.shape), r.digest, r.rows) for r in trace.records()]


def _eager_trace(path, inputs, w, background=False, names=None):
    from verify import Recorder

    with (Recorder(path, background=background, names=names) as rec,
          hooks.observe(lambda name, t, kind: rec.record(name, t, kind=kind))):
        for x_TF in inputs:
            _layer(x_TF, w)
            rec.step(param_grads=False)
    return _records(path)


def _captured_layer(tap, static_TF, w, before_capture=lambda: None) -> torch.cuda.CUDAGraph:
    """_layer on static_TF captured in a CUDA graph while `tap` observes (after a warm-up that compiles the kernels
    outside the capture); the tap's ring is left empty."""
    with hooks.observe(tap):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _layer(static_TF, w)
        torch.cuda.current_stream().wait_stream(stream)
        tap.discard()
        before_capture()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _layer(static_TF, w)
        tap.discard()  # a capture launches nothing, but leaves nothing either way
    return graph


def _graph_trace(path, inputs, w, **recorder_settings):
    """The records of _layer captured once and replayed on each input, a step each."""
    from verify import Recorder

    with Recorder(path, **recorder_settings) as rec:
        static_TF = inputs[0].clone()
        graph = _captured_layer(rec.capture("cuda"), static_TF, w)
        for x_TF in inputs:
            static_TF.copy_(x_TF)
            graph.replay()
            rec.step(param_grads=False)
    return _records(path)


@pytest.mark.parametrize("background", [False, True])
def test_cuda_graph_replays_record_the_eager_trace(tmp_path, background):
    """background: the next replay overwrites the ring while the last step is still being copied out of it."""
    w = _weights()
    inputs = [_inputs(37, seed) for seed in range(3)]
    captured = _graph_trace(tmp_path / "graph.db", inputs, w, background=background)
    eager = _eager_trace(tmp_path / "eager.db", inputs, w)
    assert captured == eager
    if background:
        assert _eager_trace(tmp_path / "eager-background.db", inputs, w, background=True) == eager


@pytest.mark.parametrize("captured_on", ["recorded step", "skipped step"])
def test_cuda_graph_replays_on_skipped_steps_record_nothing(tmp_path, captured_on):
    """every=2: a graph replayed on every step appends on the recorded ones only (the device gate), whichever
    step it was captured on; the recorded steps are the eager trace's."""
    from verify import Recorder

    w = _weights()
    inputs = [_inputs(29, seed) for seed in range(5)]
    with Recorder(tmp_path / "rate.db", every=2) as rec:
        tap = rec.capture("cuda")
        static_TF = inputs[0].clone()
        # on a skipped step: step 0 commits nothing, and the capture happens on step 1
        graph = _captured_layer(tap, static_TF, w, before_capture=(
            (lambda: rec.step(param_grads=False)) if captured_on == "skipped step" else lambda: None))
        first = rec.current_step
        for x_TF in inputs:
            static_TF.copy_(x_TF)
            graph.replay()
            assert tap.holds_entries() == rec.recording, rec.current_step
            rec.step(param_grads=False)
    recorded = [x for step, x in enumerate(inputs, start=first) if step % 2 == 0]
    eager = _eager_trace(tmp_path / "eager.db", recorded, w)
    steps = sorted({r[0] for r in _records(tmp_path / "rate.db")})
    assert [r[1:] for r in _records(tmp_path / "rate.db")] == [r[1:] for r in eager]
    assert steps == [step for step in range(first, first + len(inputs)) if step % 2 == 0]


def test_a_cuda_graph_captured_with_names_records_only_them(tmp_path):
    """names: the graph holds the tap's kernels for the names kept only; its replays record what an eager Recorder
    with the same names records."""
    w = _weights()
    inputs = [_inputs(17, seed) for seed in range(3)]
    names = ["layer.moe", "layer.norm"]
    captured = _graph_trace(tmp_path / "names.db", inputs, w, names=names)
    assert {r[2] for r in captured} == set(names)
    assert captured == _eager_trace(tmp_path / "eager.db", inputs, w, names=names)


def test_compiled_layer_records_the_eager_trace(tmp_path):
    from verify import Recorder

    w = _weights()
    inputs = [_inputs(tokens, tokens) for tokens in (5, 300, 64)]
    compiled = torch.compile(_layer, fullgraph=True, dynamic=True)
    with Recorder(tmp_path / "compiled.db") as rec:
        with hooks.observe(rec.capture("cuda")):
            for x_TF in inputs:
                compiled(x_TF, w)
                rec.step(param_grads=False)
    assert _records(tmp_path / "compiled.db") == _eager_trace(tmp_path / "eager.db", inputs, w)


def test_overflow_inside_a_graph_is_lost_on_the_host(tmp_path):
    from verify import Recorder
    from verify.errors import TraceError
    from verify.store import Trace

    w = _weights()
    static_TF = _inputs(64, 0)
    with Recorder(tmp_path / "small.db") as rec:
        tap = rec.capture("cuda", capacity=200)  # the norm's input fits, its output does not
        with hooks.observe(tap):
            _layer(static_TF, w)
            tap.discard()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                _layer(static_TF, w)
            graph.replay()
            rec.step(param_grads=False)
    with pytest.raises(TraceError, match="lost records"):
        Trace(tmp_path / "small.db")


def test_a_second_harvest_later_before_the_first_is_collected_is_refused():
    """harvest_later's staging ring holds one harvest at a time (the Recorder collects on its writer thread before
    it takes the next)."""
    from verify.capture import DeviceTap
    from verify.errors import RecorderError

    tap = DeviceTap("cuda", 1024, background=True)
    with hooks.observe(tap):
        _layer(_inputs(5, 0), _weights())
    collect = tap.harvest_later()
    with pytest.raises(RecorderError, match="not collected"):
        tap.harvest_later()
    entries, lost = collect()
    assert entries and {e.name for e in entries} == {"layer.norm", "layer.router", "layer.moe"} and not lost
    assert tap.harvest_later()() == ([], False)
