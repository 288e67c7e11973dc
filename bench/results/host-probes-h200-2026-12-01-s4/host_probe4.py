import time
import torch, triton, triton.language as tl
import mok
from mok.kernels import rms_norm as K

def host_us(fn, n=300):
    for _ in range(5): fn()
    torch.cuda.synchronize()
    s = time.perf_counter()
    for _ in range(n): fn()
    h = (time.perf_counter() - s) / n * 1e6
    torch.cuda.synchronize()
    return round(h, 1)

@triton.jit
def _noop(a, n, BLOCK: tl.constexpr):
    pass

class NoopInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()
    @staticmethod
    def backward(ctx, g):
        _noop[(1,)](g, 1, BLOCK=16)
        return g

class TenNoopsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()
    @staticmethod
    def backward(ctx, g):
        for _ in range(10):
            _noop[(1,)](g, 1, BLOCK=16)
        return g

class TenTorchOpsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()
    @staticmethod
    def backward(ctx, g):
        for _ in range(10):
            g.sum()
        return g

x = torch.randn(64, 64, device="cuda", requires_grad=True)
g = torch.randn(64, 64, device="cuda")
def run(cls):
    def f():
        x.grad = None
        cls.apply(x).backward(g)
    return f
print("10 noops main thread", host_us(lambda: [_noop[(1,)](g, 1, BLOCK=16) for _ in range(10)]))
for cls in (NoopInBackward, TenNoopsInBackward, TenTorchOpsInBackward):
    print(cls.__name__, host_us(run(cls)), flush=True)
T, F = 4096, 2048
xb = torch.randn(T, F, device="cuda", dtype=torch.bfloat16)
w = torch.ones(F, device="cuda", dtype=torch.bfloat16)
gb = torch.randn_like(xb)
print("K.rms_norm_backward main", host_us(lambda: K.rms_norm_backward(gb, xb, w, 1e-6, None, None)))
class Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()
    @staticmethod
    def backward(ctx, gy):
        K.rms_norm_backward(gb, xb, w, 1e-6, None, None)
        return gy
print("K.rms_norm_backward in backward thread (+clone node)", host_us(run(Fn)))
