"""The vLLM plugin's switches, version check and trace file naming (no engine: fast)."""
from __future__ import annotations

import importlib.metadata
import os

import pytest

pytestmark = pytest.mark.vllm


def test_entry_point_is_installed():
    points = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert {p.name: p.value for p in points}.get("mok") == "rl.vllm.plugin:register"


@pytest.mark.parametrize("env, expected", [
    ({}, False),
    ({"MOK_VLLM": "1"}, True),
    ({"MOK_VLLM": "0"}, False),
    ({"VLLM_PLUGINS": "mok"}, True),
    ({"VLLM_PLUGINS": "other,mok"}, True),
    ({"VLLM_PLUGINS": "other"}, False),
])
def test_enabled_by_one_setting(monkeypatch, env, expected):
    from rl.vllm import enabled

    for key in ("MOK_VLLM", "VLLM_PLUGINS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert enabled() is expected


def test_register_is_a_no_op_when_disabled(monkeypatch):
    from rl.vllm import plugin

    monkeypatch.delenv("MOK_VLLM", raising=False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setattr(plugin, "_registered", None)
    plugin.register()
    assert plugin.registered_ops() is None


def test_register_is_idempotent(monkeypatch, restored_vllm):
    from vllm.v1.sample.sampler import Sampler

    from rl.vllm import dense, plugin

    monkeypatch.setattr(plugin, "_registered", None)
    monkeypatch.setenv("MOK_VLLM", "1")
    monkeypatch.delenv("MOK_VLLM_OPS", raising=False)
    monkeypatch.delenv("MOK_VLLM_SKIP", raising=False)
    stock_compute_logprobs = Sampler.__dict__["compute_logprobs"]
    plugin.register()
    first = dict(restored_vllm)
    plugin.register()  # vLLM may load plugins again; its registry asserts on duplicate names
    monkeypatch.setattr(plugin, "_registered", None)
    plugin.register()  # even a fresh register() in the same process must not re-register
    assert dict(restored_vllm) == first
    assert {"UnquantizedFusedMoEMethod", "GateLinear", "RMSNorm", "LogitsProcessor"} <= set(first)
    assert first["RMSNorm"] is dense.MokRMSNorm and first["QKVParallelLinear"] is dense.MokQKVParallelLinear
    assert plugin.registered_ops() is not None and "moe" in plugin.registered_ops()
    assert Sampler.compute_logprobs is dense.compute_logprobs  # the one patch; restored after the test
    assert Sampler.__dict__["compute_logprobs"] is not stock_compute_logprobs


@pytest.mark.parametrize("preset, expected", [(None, "0"), ("0", "0"), ("1", "1")])
def test_register_keeps_vllm_on_the_model_runner_whose_sampler_mok_patches(monkeypatch, restored_vllm, preset,
                                                                           expected):
    """vLLM 0.26's V2 GPU model runner (its default for Qwen2-MoE) takes log-probabilities in its own kernel:
    register() defaults VLLM_USE_V2_MODEL_RUNNER to 0 for the processes vLLM starts; a user's value stays (and
    1 is refused at model build: tests/vllm/test_model_check.py)."""
    from rl.vllm import plugin

    monkeypatch.setattr(plugin, "_registered", None)
    monkeypatch.setenv("MOK_VLLM", "1")
    if preset is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", preset)
    plugin.register()
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == expected


def test_the_patch_did_not_leak():
    """Runs after test_register_is_idempotent (and after the engine tests, whose main process is this
    one): vLLM's own compute_logprobs and registry are back."""
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.v1.sample.sampler import Sampler

    from rl.vllm import plugin

    assert Sampler.compute_logprobs.__module__ == Sampler.__module__
    assert "RMSNorm" not in op_registry_oot and plugin.registered_ops() is None


@pytest.mark.parametrize("ops, skip, expected", [
    ("all", "", {"moe", "embedding", "rms_norm", "linear", "rotary", "silu_and_mul", "attention", "lm_head",
                 "logprobs"}),
    ("moe", "", {"moe"}),
    ("all", "rms_norm,attention", {"moe", "embedding", "linear", "rotary", "silu_and_mul", "lm_head", "logprobs"}),
    ("moe,linear", "linear", {"moe"}),
    *[(blank, "", {"moe", "embedding", "linear", "rms_norm", "rotary", "silu_and_mul", "attention", "lm_head",
                   "logprobs"}) for blank in ("", " ", ",")],  # blank is unset: every op, not none
])
def test_op_selection(monkeypatch, ops, skip, expected):
    from rl.vllm import selected_ops

    monkeypatch.setenv("MOK_VLLM_OPS", ops)
    monkeypatch.setenv("MOK_VLLM_SKIP", skip)
    assert selected_ops() == frozenset(expected)


@pytest.mark.parametrize("value, on", [("1", True), (" yes ", True), ("0", False), ("", False), ("off", False)])
def test_the_switch_reads_on_and_off(monkeypatch, value, on):
    from rl.vllm.options import enabled

    monkeypatch.setenv("MOK_VLLM", value)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert enabled() is on


@pytest.mark.parametrize("value", ["2", "y", "enable"])
def test_a_switch_value_that_is_neither_on_nor_off_is_refused(monkeypatch, value):
    from mok.errors import UnsupportedError
    from rl.vllm.options import enabled

    monkeypatch.setenv("MOK_VLLM", value)
    with pytest.raises(UnsupportedError, match=f"MOK_VLLM='{value}': expected 1"):
        enabled()


def test_unknown_op_names_are_refused(monkeypatch):
    from mok.errors import UnsupportedError
    from rl.vllm import selected_ops

    monkeypatch.setenv("MOK_VLLM_OPS", "moe,softmaxx")
    with pytest.raises(UnsupportedError, match="MOK_VLLM_OPS: unknown op.*softmaxx"):
        selected_ops()


@pytest.mark.parametrize("env, value, expected", [
    ("MOK_TRACE_EVERY", "", {"every": 1, "row_every": 1, "names": None}),
    ("MOK_TRACE_EVERY", " 4 ", {"every": 4, "row_every": 1, "names": None}),
    ("MOK_TRACE_ROW_EVERY", "16", {"every": 1, "row_every": 16, "names": None}),
    ("MOK_TRACE_NAMES", " ", {"every": 1, "row_every": 1, "names": None}),
    ("MOK_TRACE_NAMES", "layers.*.input_norm, logprobs", {"every": 1, "row_every": 1,
                                                           "names": ["layers.*.input_norm", "logprobs"]}),
    ("MOK_TRACE_NAMES", "layers.4?.moe", {"every": 1, "row_every": 1, "names": ["layers.4?.moe"]}),
    ("MOK_TRACE_RING", "", None),
    ("MOK_TRACE_RING", "4096", 4096),
])
def test_trace_settings(monkeypatch, env, value, expected):
    from rl.vllm import options

    for name in ("MOK_TRACE_EVERY", "MOK_TRACE_ROW_EVERY", "MOK_TRACE_NAMES", "MOK_TRACE_RING"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(env, value)
    read = options.trace_ring() if env == "MOK_TRACE_RING" else options.trace_rate()
    assert read == expected


@pytest.mark.parametrize("env, value, minimum", [
    ("MOK_TRACE_EVERY", "0", 1), ("MOK_TRACE_EVERY", "-2", 1), ("MOK_TRACE_ROW_EVERY", "1.5", 1),
    ("MOK_TRACE_RING", "15", 16), ("MOK_TRACE_RING", "lots", 16), ("MOK_TRACE_RING", "\u0661\u0666", 16),
])
def test_bad_trace_settings_are_refused_in_one_line(monkeypatch, env, value, minimum):
    from mok.errors import UnsupportedError
    from rl.vllm import options

    monkeypatch.setenv(env, value)
    with pytest.raises(UnsupportedError, match=f"^{env}=.*expected an integer >= {minimum}") as raised:
        options.trace_ring() if env == "MOK_TRACE_RING" else options.trace_rate()
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("value, expected", [("", False), ("0", False), ("1", True), (" 1 ", True)])
def test_trace_background_setting(monkeypatch, value, expected):
    from rl.vllm import options

    monkeypatch.setenv("MOK_TRACE_BACKGROUND", value)
    assert options.trace_background() is expected


@pytest.mark.parametrize("env, value, message", [
    ("MOK_TRACE_BACKGROUND", "yes", "expected 1"), ("MOK_TRACE_BACKGROUND", "2", "expected 1"),
    ("MOK_TRACE_BACKGROUND", "true", "expected 1"),
    ("MOK_TRACE_NAMES", "layers.*.input_nrom", "matches no traced name"),
    ("MOK_TRACE_NAMES", "lm_head,,logprobs", "matches no traced name"),
    ("MOK_TRACE_NAMES", "mlp", "matches no traced name"),
])
def test_a_bad_trace_background_or_names_setting_is_refused_in_one_line(monkeypatch, env, value, message):
    from mok.errors import UnsupportedError
    from rl.vllm import options

    monkeypatch.setenv(env, value)
    with pytest.raises(UnsupportedError, match=f"^{env}=.*{message}") as raised:
        options.trace_background() if env == "MOK_TRACE_BACKGROUND" else options.trace_rate()
    assert "\n" not in str(raised.value)


def test_trace_file_per_process(tmp_path):
    from rl.vllm import trace_files, trace_path_for_process

    base = tmp_path / "sampler.db"
    assert trace_path_for_process(base, 123) == tmp_path / "sampler.123.db"
    assert trace_path_for_process(str(tmp_path) + "/", 7) == tmp_path / "vllm.7.db"
    assert trace_path_for_process(tmp_path / "run", 9) == tmp_path / "run.9.db"
    for pid in (5, 17):
        trace_path_for_process(base, pid).write_bytes(b"")
    (tmp_path / "sampler.other.db").write_bytes(b"")
    (tmp_path / "sampler.db-wal").write_bytes(b"")
    assert trace_files(base) == [tmp_path / "sampler.17.db", tmp_path / "sampler.5.db"]
    directory = tmp_path / "traces"
    directory.mkdir()
    for pid in (3, 40):
        trace_path_for_process(directory, pid).write_bytes(b"")
    (directory / "vllm.3-1.db").write_bytes(b"")  # a second process that got pid 3
    (directory / "vllm.db").write_bytes(b"")
    assert trace_files(str(directory) + "/") == [directory / "vllm.3-1.db", directory / "vllm.3.db",
                                                 directory / "vllm.40.db"]


def test_rms_norms_are_named_from_their_module_paths():
    """vLLM builds RMSNorm without a prefix: the model's first forward names every MokRMSNorm from its
    path in named_modules(), for each model built in the process (the demo restarts its sampler)."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config

    from rl.vllm import dense

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_norm = dense.MokRMSNorm(8)  # q/k norms are not traced

    class DecoderLayer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = Attention()
            self.input_layernorm = dense.MokRMSNorm(8)
            self.post_attention_layernorm = dense.MokRMSNorm(8)

        def forward(self, x):
            return x

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([DecoderLayer() for _ in range(2)])
            self.norm = dense.MokRMSNorm(8)

    class ForCausalLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Decoder()

        def forward(self, x):
            return x

    def names(model):
        return [(layer.input_layernorm.mok_trace_name, layer.self_attn.q_norm.mok_trace_name,
                 layer.post_attention_layernorm.mok_trace_name) for layer in model.model.layers]

    try:
        with set_current_vllm_config(VllmConfig()):
            for _ in range(2):
                model = ForCausalLM()
                assert dense._naming_hook is not None and model.model.norm.mok_trace_name is None
                model.model.layers[1](torch.zeros(1))  # a layer on its own: its paths name nothing
                assert names(model)[1] == (None, None, None)
                model(torch.zeros(1))  # the first forward of the model names every norm in it
                assert names(model) == [("layers.0.input_norm", None, "layers.0.post_attention_norm"),
                                        ("layers.1.input_norm", None, "layers.1.post_attention_norm")]
                assert model.model.norm.mok_trace_name == "final_norm"
                assert dense._naming_hook is None  # removed once every norm has its name
    finally:
        if dense._naming_hook is not None:
            dense._naming_hook.remove()
            dense._naming_hook = None


def test_worker_tracer_commits_a_step_per_forward(tmp_path):
    """The worker's recorder: one file per process, a step committed by the op that ends a forward; what ran before
    the first served forward (vLLM's warm-up and compile runs, which skip the runner's forward hook) is dropped."""
    import torch

    from rl import trace_names
    from rl.vllm.plugin import check_vllm_version
    from rl.vllm.trace import WorkerTracer
    from verify import Trace

    tracer = WorkerTracer(str(tmp_path / "sampler.db"))  # the class behind worker_tracer(), unattached
    tracer.close_forward_after("lm_head")
    rows = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    for warm_up in range(2):  # a whole forward, its last op included: not a step
        tracer("layers.0.moe", rows - warm_up, "input")
        tracer("lm_head", rows - warm_up, "output")
    for forward in range(2):
        tracer.begin_forward()
        tracer("layers.0.moe", rows + forward, "input")
        tracer("layers.0.moe", rows * 2 + forward, "output")
        tracer("lm_head", rows, "output")
    tracer.begin_forward()
    tracer("layers.0.moe", rows, "input")  # a forward cut short: committed on close
    with Trace(tracer.path) as trace:  # readable while the tracer is open: two committed steps
        assert [s[0] for s in trace.steps()] == [0, 1]
    tracer.close()
    with Trace(tracer.path) as trace:
        steps = [(r.step, r.name, r.kind) for r in trace.records()]
        assert trace.meta["side"] == "sampler" and trace.meta["pid"] == os.getpid()
        assert trace.meta["vllm"] == check_vllm_version()  # the version the plugin checked, no '+cpu'
        assert trace.meta["aligned_ops"] == list(trace_names.per_row_globs())  # what `mok-verify report` aligns
    assert steps == [(0, "layers.0.moe", "input"), (0, "layers.0.moe", "output"), (0, "lm_head", "output"),
                     (1, "layers.0.moe", "input"), (1, "layers.0.moe", "output"), (1, "lm_head", "output"),
                     (2, "layers.0.moe", "input")]
    assert tracer.path == tmp_path / f"sampler.{os.getpid()}.db"


def test_no_tracer_without_mok_trace(monkeypatch):
    from mok import hooks
    from rl.vllm import trace

    monkeypatch.delenv("MOK_TRACE", raising=False)
    monkeypatch.setattr(trace, "_tracer", None)
    assert trace.worker_tracer() is None
    assert not hooks.observed()  # the unrecorded path: mok's ops skip every emit


def test_the_worker_ring_holds_a_forward_at_the_engines_token_limit(monkeypatch):
    """Unset MOK_TRACE_RING: the ring is sized from the engine (max_num_batched_tokens x layers), so a full-depth
    Qwen3-30B-A3B prefill of 16384 tokens (48 layers x 13 row records, the most rl/trace_names.py names) fits
    twice; a small engine keeps verify's default."""
    from types import SimpleNamespace

    from rl.vllm import trace, vllm_internals
    from rl.vllm.options import trace_ring
    from verify.capture import DEFAULT_CAPACITY

    def engine(tokens, layers):
        return SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=tokens),
                               model_config=SimpleNamespace(hf_config=SimpleNamespace(num_hidden_layers=layers)))

    monkeypatch.setattr(vllm_internals, "current_vllm_config", lambda: engine(16384, 48))
    entries = trace.engine_ring_entries()
    assert entries >= 2 * (16384 * (13 * 48 + 6)) > DEFAULT_CAPACITY["cuda"]
    monkeypatch.setattr(vllm_internals, "current_vllm_config", lambda: engine(256, 2))
    assert trace.engine_ring_entries() is None  # below the default: the default
    monkeypatch.setattr(vllm_internals, "current_vllm_config", lambda: None)
    assert trace.engine_ring_entries() is None
    monkeypatch.setenv("MOK_TRACE_RING", "4096")
    assert trace_ring() == 4096  # the user's setting wins (WorkerTracer: trace_ring() or engine_ring_entries())
