"""mok's MLA backend on CUDA engines (registered for every dense MLA backend vLLM's CUDA platform may select:
vllm_internals_mla.GPU_MLA_BACKENDS): vLLM's Triton MLA backend, whose metadata builder (persistent device buffers,
full CUDA graphs for single-token decode steps), KV-cache shape and cache writes are kept, with mok's impl and a
builder that hands rl/vllm/mla.py's `forward` the step's sequences as device tensors it never reads on the host.
The attention itself is rl/vllm/mla.py's, the same on every platform. Written against vLLM 0.26.0's wheel; not yet
run on a GPU (docs/vllm.md)."""
from __future__ import annotations

from rl.vllm import vllm_internals_mla
from rl.vllm.mla import MokMLABackendBase, MokMLAImplBase

TritonMLABackend, TritonMLAImpl, TritonMLAMetadataBuilder = vllm_internals_mla.gpu_mla_classes()
BACKEND_NAMES = vllm_internals_mla.GPU_MLA_BACKENDS


class MokMLAImpl(MokMLAImplBase, TritonMLAImpl):
    """The impl mok's MLA layers are built with on CUDA engines (vLLM's cache writes, mok's attention)."""


class MokMLABackend(MokMLABackendBase, TritonMLABackend):
    """TRITON_MLA (and the other dense MLA backends' names) with mok's impl and step-carrying builder."""

    supported_kv_cache_dtypes = ["auto", "bfloat16", "float16"]
    impl_cls = MokMLAImpl
    builder_cls = vllm_internals_mla.with_step(TritonMLAMetadataBuilder, on_host=False)

    @staticmethod
    def get_name() -> str:
        return "TRITON_MLA"
