"""One data-parallel rank of a vLLM engine group with expert parallelism and the mok plugin (vLLM's offline
data-parallel recipe: one process per DP rank, VLLM_DP_* in the environment). Run by test_vllm_dp_ep.py:

    python -m tests.distributed.vllm_dp_rank RANK SIZE MASTER_PORT CHECKPOINT OUT.json

Samples a few prompts (a different number per rank, so that one rank idles while the other decodes) and
writes the samples and the expert-weight shapes its MoE layers hold.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys


def local_expert_shapes(model) -> list[list[int]]:
    """The w13 shapes of the MoE layers of a vLLM model (in its worker)."""
    return sorted({tuple(m.w13_weight.shape) for m in model.modules() if hasattr(m, "w13_weight")})


def main(rank: int, size: int, port: str, checkpoint: str, out: str) -> int:
    os.environ.update(VLLM_DP_RANK=str(rank), VLLM_DP_RANK_LOCAL=str(rank), VLLM_DP_SIZE=str(size),
                      VLLM_DP_MASTER_IP="127.0.0.1", VLLM_DP_MASTER_PORT=port, MOK_VLLM="1",
                      VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    from rl.vllm.testing import generate, mixed_prompts, shutdown

    # by its importable name (this file runs as __main__, which the engine's workers cannot import)
    from tests.distributed.vllm_dp_rank import local_expert_shapes

    llm = LLM(model=checkpoint, enforce_eager=True, gpu_memory_utilization=0.3, dtype="bfloat16",
              skip_tokenizer_init=True, max_model_len=128, max_num_seqs=8, enable_expert_parallel=True,
              enable_prefix_caching=False, seed=0)
    try:
        prompts = mixed_prompts([3, 8, 13][:2 + rank % 2], seed=rank)
        samples = generate(llm, prompts, max_tokens=6, seed=100 * rank)
        shapes = llm.apply_model(local_expert_shapes)
    finally:
        shutdown(llm)
    with open(out, "w") as f:
        json.dump({"samples": [dataclasses.asdict(s) for s in samples], "expert_shapes": shapes}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]))
