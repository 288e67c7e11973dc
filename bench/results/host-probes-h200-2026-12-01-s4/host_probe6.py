import time
import torch
import mok
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

class Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return K.rms_norm(x, None, w, 1e-6)[0]
    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        gx, _, gw = K.rms_norm_backward(gy, x, w, 1e-6, None, None)
        return gx, gw

def step(f):
    def run():
        x.grad = w.grad = None
        torch.autograd.backward(f(), g)
    return run

cases = [("mok.rms_norm", step(lambda: mok.rms_norm(x, w, 1e-6))),
         ("autograd.Function over kernels", step(lambda: Fn.apply(x, w))),
         ("F.rms_norm", step(lambda: torch.nn.functional.rms_norm(x, (2048,), w, 1e-6)))]
for name, fn in cases:
    print(f"{name} fwd+bwd: {host_us(fn)} us", flush=True)
with torch.autograd.set_multithreading_enabled(False):
    for name, fn in cases:
        print(f"{name} fwd+bwd, backward on the calling thread: {host_us(fn)} us", flush=True)
with torch.no_grad():
    print("mok.rms_norm forward no_grad", host_us(lambda: mok.rms_norm(x, w, 1e-6)))
