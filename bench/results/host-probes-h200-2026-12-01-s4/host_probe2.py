import time
import torch, triton, triton.language as tl
import mok
import mok.ops.rms_norm  # noqa
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
def _noop(a, b, c, d, e, n, m, BLOCK: tl.constexpr):
    pass

T, F = 4096, 2048
x = torch.randn(T, F, device="cuda", dtype=torch.bfloat16)
w = torch.ones(F, device="cuda", dtype=torch.bfloat16)
g = torch.randn_like(x)
sq = torch.empty(T, F, device="cuda", dtype=torch.float32)
gw = torch.empty_like(sq)
cfg = K.rms_norm_backward_config(F)
grid = (triton.cdiv(T, cfg["BLOCK_T"]), triton.cdiv(F, cfg["BLOCK_F"]))
print("noop 8 args", host_us(lambda: _noop[(1,)](x, w, g, sq, gw, T, F, BLOCK=16)))
print("noop 8 args fp_fusion", host_us(lambda: _noop[(1,)](x, w, g, sq, gw, T, F, BLOCK=16, enable_fp_fusion=False)))
print("products kernel", host_us(lambda: K._rms_norm_backward_products_kernel[grid](
    g, x, w, sq, gw, T, F, *g.stride(), *x.stride(), *sq.stride(), enable_fp_fusion=False, **cfg)))
print("torch.empty", host_us(lambda: torch.empty(T, F, device="cuda", dtype=torch.float32)))
print("sum(-1)", host_us(lambda: sq.sum(-1, keepdim=True)))
#print("K.rms_norm_backward", host_us(lambda: K.rms_norm_backward(g, x, w, 1e-6, None, None)))
print("torch.ops.mok.rms_norm_backward", host_us(lambda: torch.ops.mok.rms_norm_backward(g, x, w, 1e-6, None, None)))
print("K.rms_norm fwd", host_us(lambda: K.rms_norm(x, None, w, 1e-6)))
with torch.no_grad():
    print("mok.rms_norm no_grad", host_us(lambda: mok.rms_norm(x, w, 1e-6)))
    print("torch.ops.mok.rms_norm no_grad", host_us(lambda: torch.ops.mok.rms_norm(x, w, 1e-6)))
xg = x.clone().requires_grad_()
print("mok.rms_norm fwd with grad", host_us(lambda: mok.rms_norm(xg, w, 1e-6)))
def fb():
    xg.grad = None
    mok.rms_norm(xg, w, 1e-6).backward(g)
print("mok.rms_norm fwd+bwd", host_us(fb, 100))
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
def fb2():
    xg.grad = None
    Fn.apply(xg, w).backward(g)
print("autograd.Function direct fwd+bwd", host_us(fb2, 100))
def fb3():
    xg.grad = None
    torch.nn.functional.rms_norm(xg, (F,), w, 1e-6).backward(g)
print("F.rms_norm fwd+bwd", host_us(fb3, 100))
