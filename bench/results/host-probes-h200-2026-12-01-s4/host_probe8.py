import time
import torch
import mok
import mok.ops.rms_norm as R
from mok.kernels import rms_norm as K

def host_us(fn, n=200):
    for _ in range(10): fn()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(3):
        s = time.perf_counter()
        for _ in range(n): fn()
        best = min(best, (time.perf_counter() - s) / n * 1e6)
        torch.cuda.synchronize()
    return round(best, 1)

x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16).requires_grad_()
w = torch.ones(2048, device="cuda", dtype=torch.bfloat16).requires_grad_()
g = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)

class OverKernels(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return K.rms_norm(x, None, w, 1e-6)[0]
    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        gx, _, gw = K.rms_norm_backward(gy, x, w, 1e-6, None, None)
        return gx, gw

class OverOps(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return R._rms_norm_op(x, w, 1e-6)
    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        gx, _, gw = R._rms_norm_backward_op(gy.contiguous(), x, w, 1e-6, None, None)
        return gx, gw

def step(f):
    def run():
        x.grad = w.grad = None
        torch.autograd.backward(f(), g)
    return run

for name, fn in [("mok.rms_norm (custom op with register_autograd)", step(lambda: mok.rms_norm(x, w, 1e-6))),
                 ("autograd.Function over the custom ops", step(lambda: OverOps.apply(x, w))),
                 ("autograd.Function over kernels", step(lambda: OverKernels.apply(x, w))),
                 ("F.rms_norm", step(lambda: torch.nn.functional.rms_norm(x, (2048,), w, 1e-6)))]:
    print(f"{name} fwd+bwd: {host_us(fn)} us", flush=True)
