"""Input checks shared by mok's ops: dense layouts, float dtypes, devices, router logits and replayed expert ids.

Shapes: docs/shapes.md. Every check raises mok.errors.UnsupportedError with a message naming the input.
"""
from __future__ import annotations

import math
import numbers

import torch

from mok.errors import UnsupportedError

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def check_tensor(value, label: str) -> None:
    """`value` is a dense torch.Tensor (label: "op: name", for the message)."""
    if not isinstance(value, torch.Tensor):
        raise UnsupportedError(f"{label} must be a tensor, got {type(value).__name__}")
    check_dense(value, label)


def check_dense(value: torch.Tensor, label: str) -> None:
    """A strided (dense) tensor: not sparse (COO, CSR, ...), not nested. mok's ops read strided memory only."""
    if value.layout is not torch.strided or value.is_nested:
        layout = "nested" if value.is_nested else str(value.layout).removeprefix("torch.")
        raise UnsupportedError(f"{label} must be a dense (strided) tensor, got a {layout} tensor "
                               "(convert it with .to_dense())")


def check_real(value, label: str, *, positive: bool = False, nonnegative: bool = False) -> float:
    """A finite real number (not a bool, not a tensor), > 0 or >= 0 when asked. -> float(value)."""
    if (type(value) is not float and (isinstance(value, bool) or not isinstance(value, numbers.Real))
            or not math.isfinite(value)):  # (a float first: the ABC's isinstance is slow, and this runs per call)
        raise UnsupportedError(f"{label} must be a finite real number, got {value!r}")
    if positive and not value > 0:
        raise UnsupportedError(f"{label} must be > 0, got {value!r}")
    if nonnegative and not value >= 0:
        raise UnsupportedError(f"{label} must be >= 0, got {value!r}")
    return float(value)


def check_bool(value, label: str) -> bool:
    """A bool (numpy's and torch's 0-d bools are not: they are tensors or numbers that happen to be truthy)."""
    if not isinstance(value, bool):
        raise UnsupportedError(f"{label} must be True or False, got {value!r}")
    return value


def check_name(name, op: str) -> None:
    """An op's trace `name`: a str or None (the records it emits carry it)."""
    if name is not None and not isinstance(name, str):
        raise UnsupportedError(f"{op}: name must be a str or None, got {name!r}")


def check_int(value, label: str) -> int:
    """An integer (not a bool, not a float, not a tensor). -> int(value)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise UnsupportedError(f"{label} must be an int, got {value!r}")
    return int(value)


def check_device(*tensors: torch.Tensor) -> None:
    """All tensors dense, on one device, and that device a CPU or a CUDA device."""
    device = tensors[0].device
    for t in tensors:
        if t.layout is not torch.strided or t.is_nested:
            check_dense(t, "every tensor input")
        if t.device != device:
            raise UnsupportedError(f"all inputs must be on one device, got {device} and {t.device}")
    if device.type not in ("cpu", "cuda"):
        raise UnsupportedError(f"mok ops run on cpu or cuda tensors, not {device.type}")


def check_router_logits(router_logits_TE: torch.Tensor, top_k: int) -> None:
    """Router logits [T, E] of a float dtype on cpu or cuda, and 1 <= top_k <= E."""
    check_tensor(router_logits_TE, "router_logits")
    if router_logits_TE.dim() != 2:
        raise UnsupportedError(
            f"router_logits must be [num_tokens, num_experts], got shape {tuple(router_logits_TE.shape)}")
    if router_logits_TE.dtype not in FLOAT_DTYPES:
        raise UnsupportedError(
            f"router_logits dtype {router_logits_TE.dtype} is not supported (float32, bfloat16, float16)")
    if router_logits_TE.device.type not in ("cpu", "cuda"):
        raise UnsupportedError(f"device {router_logits_TE.device} is not supported (cpu, cuda)")
    num_experts = router_logits_TE.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise UnsupportedError(f"top_k must be an int in [1, {num_experts}], got {top_k!r}")


def check_topk_ids(topk_ids_TK: torch.Tensor, num_tokens: int, top_k: int, num_experts: int,
                   device: torch.device) -> None:
    """Replayed expert ids: int32/int64 [T, K] on `device`, values in [0, E) (checked on the CPU only)."""
    if not isinstance(topk_ids_TK, torch.Tensor) or topk_ids_TK.dtype not in (torch.int32, torch.int64):
        raise UnsupportedError("topk_ids must be an int32 or int64 tensor")
    check_dense(topk_ids_TK, "topk_ids")
    if tuple(topk_ids_TK.shape) != (num_tokens, top_k):
        raise UnsupportedError(f"topk_ids must have shape {(num_tokens, top_k)}, got {tuple(topk_ids_TK.shape)}")
    if topk_ids_TK.device != device:
        raise UnsupportedError(f"topk_ids is on {topk_ids_TK.device}, expected {device}")
    # A range check needs the values on the host: free on the CPU, a sync on CUDA (skipped there).
    if topk_ids_TK.device.type == "cpu" and topk_ids_TK.numel() and not torch.compiler.is_compiling():
        lo, hi = int(topk_ids_TK.min()), int(topk_ids_TK.max())
        if lo < 0 or hi >= num_experts:
            raise UnsupportedError(f"topk_ids must lie in [0, {num_experts}), got values in [{lo}, {hi}]")
