"""Fixtures of the vLLM tests: undo what the plugin installs in the test process.

vLLM loads its plugins in the process that creates `vllm.LLM` too, so with MOK_VLLM=1 the test process
itself gets mok's classes in vLLM's registries and the patched `Sampler.compute_logprobs`. Every test
and fixture that registers (an engine start, `plugin.register()`) restores them when it ends, so no
patch leaks into the tests that run after it.
"""
from __future__ import annotations

import contextlib
import os

import pytest


@contextlib.contextmanager
def _vllm_state_restored():
    """Yields vLLM's op_registry_oot; afterwards restores it, the CPU_ATTN backend override,
    Sampler.compute_logprobs, the plugin's state, the override classes' switches and the model-runner
    variable register() sets."""
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.sample.sampler import Sampler

    from rl.vllm import dense, moe, plugin

    switches = [(cls, "observe_only", cls.observe_only) for cls in (dense.MokRMSNorm, dense.MokLinear,
                                                                    dense.MokLogitsProcessor)]
    switches.append((moe.MokFusedMoEMethod, "ends_forward", moe.MokFusedMoEMethod.ends_forward))
    compute_logprobs = Sampler.__dict__["compute_logprobs"]  # the staticmethod object itself
    registered = dict(op_registry_oot)
    attention = AttentionBackendEnum.CPU_ATTN
    attention_path = attention.get_path() if attention.is_overridden() else None
    plugin_state = plugin._registered
    runner = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    try:
        yield op_registry_oot
    finally:
        plugin._registered = plugin_state
        if runner is None:
            os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
        else:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = runner
        attention.clear_override()
        if attention_path is not None:
            register_backend(attention, attention_path)
        op_registry_oot.clear()
        op_registry_oot.update(registered)
        Sampler.compute_logprobs = compute_logprobs
        for cls, name, value in switches:
            setattr(cls, name, value)


@pytest.fixture
def restored_vllm():
    """For one test: what register() installs in this process is undone afterwards (yields op_registry_oot)."""
    with _vllm_state_restored() as registry:
        yield registry


@pytest.fixture(scope="module")
def restored_vllm_module():
    """The same for a module's engine fixture (the engine's main process is this one)."""
    with _vllm_state_restored() as registry:
        yield registry
