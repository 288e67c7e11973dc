"""verl's real classes on the CPU: verl's platform registry gets a CPU platform (tests/verl/cpu_platform.py)
before any verl worker module is imported, and the session runs in a one-process gloo group (verl's FSDP2
engine needs torch.distributed). These tests run in verl's own environment (.venv-verl: `./run test` runs
them there); the main environment skips the folder (tests/conftest.py)."""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist

from tests.verl import cpu_platform

cpu_platform.install()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session", autouse=True)
def process_group():
    """One rank of gloo: what verl's engine reads its data-parallel layout from."""
    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
        dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint (bf16 safetensors, word-level tokenizer): rl.testing's."""
    from rl.testing import save_tiny_checkpoint

    return save_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"), seed=0)


def build_engine(engine_class, checkpoint, **engine_settings):
    """verl's engine `engine_class` built and initialised by verl (its configs, its FSDP2 set-up) on the CPU.
    engine_settings override FSDPEngineConfig fields. Flash attention is not on the CPU: sdpa for the
    transformers model verl loads (mok's engine does not call its attention)."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig

    model_config = HFModelConfig(path=str(checkpoint), enable_gradient_checkpointing=False,
                                 override_config={"attn_implementation": "sdpa"})
    engine_config = FSDPEngineConfig(**{"strategy": "fsdp2", "use_torch_compile": False, **engine_settings})
    engine = engine_class(model_config, engine_config, FSDPOptimizerConfig(lr=1e-2, total_training_steps=2),
                          CheckpointConfig())
    engine.initialize()
    return engine


@pytest.fixture(scope="module")
def mok_engine(checkpoint):
    from rl.verl import MokFSDPEngineWithLMHead

    return build_engine(MokFSDPEngineWithLMHead, checkpoint)


@pytest.fixture(scope="module")
def stock_engine(checkpoint):
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    return build_engine(FSDPEngineWithLMHead, checkpoint)


@pytest.fixture(scope="module")
def bf16_model():
    """The checkpoint's model as vLLM loads it (bf16), unsharded, for the reference paths."""
    from rl.testing import tiny_model

    return tiny_model("qwen3_moe", seed=0, dtype=torch.bfloat16)
