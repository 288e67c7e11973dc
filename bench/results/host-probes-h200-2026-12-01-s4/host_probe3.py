import sys, time, threading
import torch

def host_us(fn, n=300):
    for _ in range(5): fn()
    torch.cuda.synchronize()
    s = time.perf_counter()
    for _ in range(n): fn()
    h = (time.perf_counter() - s) / n * 1e6
    torch.cuda.synchronize()
    return round(h, 1)

class Ident(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()
    @staticmethod
    def backward(ctx, g):
        return g

for dev in ("cpu", "cuda"):
    x = torch.randn(64, 64, device=dev, requires_grad=True)
    g = torch.randn(64, 64, device=dev)
    def c():
        x.grad = None
        (x * 1).backward(g)
    def p():
        x.grad = None
        Ident.apply(x).backward(g)
    def p2():
        x.grad = None
        Ident.apply(Ident.apply(x)).backward(g)
    print(dev, "C++ node", host_us(c), "python node", host_us(p), "two python nodes", host_us(p2), flush=True)
    sys.setswitchinterval(1e-5)
    print(dev, "switchinterval 10us: C++ node", host_us(c), "python node", host_us(p), "two", host_us(p2), flush=True)
    sys.setswitchinterval(0.005)
print(threading.enumerate())
