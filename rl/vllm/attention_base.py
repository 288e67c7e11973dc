"""What mok's two vLLM attention impls (rl/vllm/attention.py on CPU engines, attention_gpu.py on CUDA
engines) share: the refusal of what mok's attention does not compute, the trace name of each layer and the
observe-only switch. No vLLM import: each impl module brings its own vLLM base class."""
from __future__ import annotations

from mok.errors import UnsupportedError
from rl import trace_names


class MokAttentionBase:
    """Mixed into a vLLM attention impl, before its vLLM base class.

    observe_only (a class attribute of each impl, set by overrides.install for MOK_VLLM_SKIP=attention with
    MOK_TRACE): vLLM's own kernels compute, and only the trace records.
    """

    observe_only = False

    def __init__(self, *args, **kwargs):
        """The model check, the vLLM impl's own __init__, then the refusal of what mok's attention does not compute."""
        from rl.vllm import vllm_internals
        from rl.vllm.model_check import check_current_model

        check_current_model()
        super().__init__(*args, **kwargs)
        self.refuse(vllm_internals.attention_impl_problem(self))

    @staticmethod
    def refuse(problem: str | None) -> None:
        """Raise UnsupportedError naming `problem` (from vllm_internals' impl checks), unless it is None."""
        if problem is not None:
            raise UnsupportedError(f"mok vLLM hook: {problem} is not supported")

    def _name(self, layer) -> str | None:
        """The trace name of `layer` (`layers.{i}.attention`), or None outside a decoder layer."""
        names = self.__dict__.setdefault("_mok_names", {})
        if id(layer) not in names:
            names[id(layer)] = trace_names.from_vllm_module(getattr(layer, "layer_name", ""))
        return names[id(layer)]
