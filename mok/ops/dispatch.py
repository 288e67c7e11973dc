"""How mok's custom ops are registered and called: `register` (the op's CUDA kernel and autograd formula,
in one place) returns an `EagerOp`, the callable the public functions use.

Every mok op is a torch.library custom op: what torch.compile, vLLM's compiled mode, fake tensors,
torch.library.opcheck and functorch see. An eager call of a custom op, though, runs torch's Python around
its implementation: CustomOpDef.__call__, an autograd kernel that builds a torch.autograd.Function and
redispatches, a backend wrapper (aliasing check, dynamo guard). That costs more host time than mok's own
launches (docs/performance.md, "Host time per call").

An EagerOp call that is plain eager (not traced by torch.compile, no TorchDispatchMode or
TorchFunctionMode active, no functorch transform, every tensor argument a plain torch.Tensor or
nn.Parameter, all on one device, every argument given) runs the op's implementation for that device
itself: the function registered for CUDA, the op's default (reference) implementation on the CPU. When the
op has an autograd formula and an input requires a gradient, the call is recorded by one
torch.autograd.Function that runs the op's own setup_context and backward. Any other call goes to the
op. The same functions run on either path, so values and bits cannot differ (tests/mok/test_dispatch.py
compares both paths' outputs and gradients for every op). Every CUDA implementation registered here runs on its
tensors' device, whichever device is current (`on_tensors_device`). An op registered with `native=` (mok.rms_norm's two,
mok.linear, mok.moe's inference op) goes one step further on CUDA: its plain eager call runs a C++ function whose
forward, backward and autograd node replay the launches of these same functions (mok/kernels/native; docs/kernels.md,
"Native eager path"). mok.rms_norm and mok.linear go further still: before their own checks they offer the whole call
to the native path (`native_call`), which checks it in C++ and runs it, or declines it to their Python."""
from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
ENABLED = True  # tests turn it off to run the same calls through the custom ops


class EagerOp:
    """A custom op as the public functions call it: positional arguments, the op's schema (module doc)."""

    def __init__(self, op, cuda: Callable | None, backward: Callable | None, setup_context: Callable | None,
                 eager_cuda: Callable | None = None, native: str | None = None):
        self.op = op
        default = getattr(op, "_init_fn", None)  # torch's CustomOpDef keeps the decorated function there
        on_cuda = eager_cuda or cuda or default
        self.impls = {device: fn for device, fn in (("cpu", default),
                                                    ("cuda", on_cuda and on_tensors_device(on_cuda)))
                      if fn is not None}
        self.backward = backward
        self.setup_context = setup_context
        self.native = native
        self.arity = len(op._opoverload._schema.arguments)
        self.__name__ = op._name

    def __call__(self, *args):
        device, requires_grad = _plain_eager_call(args) if ENABLED and len(args) == self.arity else (None, False)
        impl = self.impls.get(device)
        if impl is None:
            return self.op(*args)
        if device == "cuda" and self.native is not None:
            native = _native_function(self.native)
            if native is not None:
                return native(*args)
        if requires_grad and torch.is_grad_enabled():
            if self.backward is None:
                return self.op(*args)  # no formula: the op's own autograd kernel says what that means
            return _Recorded.apply(self, impl, *args)
        return impl(*args)


def register(op, *, cuda: Callable | None = None, backward: Callable | None = None,
             setup_context: Callable | None = None, eager_cuda: Callable | None = None,
             native: str | None = None) -> EagerOp:
    """Registers `cuda` as op's CUDA kernel (None: the default implementation runs there too) and (backward,
    setup_context) as its autograd formula (torch.library's register_autograd contract), and returns the
    EagerOp the public functions call. `eager_cuda`: what a plain eager call runs on CUDA instead of `cuda`, with
    the same values (the MoE's decode launch plans, which keep memory between calls: a call through the op may
    run inside a graph's memory pool, torch.compile's cudagraph trees, where nothing may outlive the call).
    `native`: the name of the native eager path's function (mok/kernels/native: the same launches, with the forward,
    backward and autograd node in C++) that a plain eager CUDA call runs instead of everything above, its autograd
    included, wherever that path is available (native.function).
    Ops that mutate an argument are not registered here: their eager calls go through the op, which keeps the
    mutated tensors' version counters."""
    if op._opoverload._schema.is_mutable:
        raise ValueError(f"{op._name} mutates an argument: call the op itself")
    if cuda is not None:
        op.register_kernel("cuda")(on_tensors_device(cuda))
    if backward is not None:
        op.register_autograd(backward, setup_context=setup_context)
    return EagerOp(op, cuda, backward, setup_context, eager_cuda, native)


def on_tensors_device(cuda: Callable) -> Callable:
    """`cuda` (an op's CUDA implementation) run with its first tensor argument's device as the current CUDA device,
    when another one is current. Triton launches on the current device (its stream, its compiled kernels), not on
    the tensors' device: a layer on cuda:1 of a process whose current device is cuda:0 (transformers'
    `device_map="auto"` places layers so) would run its kernels on cuda:0 with cuda:1's pointers, a crash or garbage.
    The native eager path guards the device in C++ (mok/kernels/native/native.cpp)."""

    @functools.wraps(cuda)
    def run(*args, **kwargs):
        for a in args:
            if isinstance(a, torch.Tensor):
                if a.is_cuda and a.device.index != torch.cuda.current_device():
                    with torch.cuda.device(a.device.index):
                        return cuda(*args, **kwargs)
                break
        return cuda(*args, **kwargs)

    return run


_native = None  # mok.kernels.native, imported on the first call that asks for it (it imports Triton's kernels)


def _native_function(name: str) -> Callable | None:
    global _native
    if _native is None:
        from mok.kernels import native as module

        _native = module
    return _native.function(name)


def native_call(name: str, first, *rest):
    """A public function's whole call on the native path, or None. `name`: a native function taking the public
    function's own arguments (first, *rest), which checks them itself and runs a plain eager CUDA call of valid
    arguments whole (rows merged, output shaped back), or answers None (mok/kernels/native/native.cpp, "whole public
    calls"). Asked only in a plain mode (module doc) with `first` a plain CUDA tensor. None: the caller checks its
    arguments itself (raising mok's typed errors) and calls its EagerOp. The Python checks and dispatch cost more host
    time than the C++ forward they lead to (docs/kernels.md, "Native eager path")."""
    if not (ENABLED and _plain_mode() and type(first) in _PLAIN_TENSORS and first.is_cuda):
        return None
    function = _native_function(name)
    return None if function is None else function(first, *rest)


def rows(t: torch.Tensor) -> torch.Tensor:
    """t [..., F] as [T, F] (leading dims merged): t itself when it is 2-D. A reshape of a tensor that requires grad
    adds an autograd node even when it moves nothing, and each node costs host time in the backward."""
    return t if t.dim() == 2 else t.reshape(math.prod(t.shape[:-1]), t.shape[-1])  # no -1: F may be 0


def shaped(t: torch.Tensor, shape) -> torch.Tensor:
    """t reshaped to `shape`: t itself when it has that shape already (rows)."""
    return t if t.shape == shape else t.reshape(shape)


class _Recorded(torch.autograd.Function):
    """One eager op call recorded with the op's own autograd formula (what torch.library builds per call).
    The formula's setup_context runs inside forward: a Function with a setup_context of its own binds its
    arguments through inspect.signature at every apply (torch/autograd/function.py): 17 against 6 us per apply
    on a CPU machine."""

    @staticmethod
    def forward(ctx, eager_op, impl, *args):
        output = impl(*args)
        ctx.eager_op = eager_op
        eager_op.setup_context(ctx, args, output)
        return output

    @staticmethod
    def backward(ctx, *grads):
        grads_in = ctx.eager_op.backward(ctx, *grads)
        return (None, None, *(grads_in if isinstance(grads_in, tuple) else (grads_in,)))


def _plain_eager_call(args) -> tuple[str | None, bool]:
    """(the device type of a plain eager call (module doc), else None; whether a tensor argument requires grad)."""
    if not _plain_mode():
        return None, False
    device, requires_grad = None, False
    for a in args:
        if isinstance(a, torch.Tensor):
            if type(a) not in _PLAIN_TENSORS:
                return None, False
            if device is None:
                device = a.device
            elif a.device != device:
                return None, False
            requires_grad = requires_grad or a.requires_grad
    return (None if device is None else device.type), requires_grad


def _plain_mode() -> bool:
    """No torch.compile tracing, TorchDispatchMode, TorchFunctionMode or functorch transform active."""
    return not (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
                or torch._C._is_torch_function_mode_enabled() or torch._C._are_functorch_transforms_active())
