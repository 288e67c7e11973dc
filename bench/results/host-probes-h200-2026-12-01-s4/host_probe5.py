import time
import torch, triton, triton.language as tl
from mok.kernels import rms_norm as K

def host_us(fn, n=400):
    for _ in range(10): fn()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(3):
        s = time.perf_counter()
        for _ in range(n): fn()
        best = min(best, (time.perf_counter() - s) / n * 1e6)
        torch.cuda.synchronize()
    return round(best, 1)

@triton.jit
def _noop(a, n, BLOCK: tl.constexpr):
    pass

x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
w = torch.ones(2048, device="cuda", dtype=torch.bfloat16)
g = torch.randn_like(x)
direct = lambda: K.rms_norm(x, None, w, 1e-6)
disabled = torch._disable_dynamo(direct)
noops = lambda: [_noop[(1,)](x, 1, BLOCK=16) for _ in range(10)]
noops_disabled = torch._disable_dynamo(noops)
bwd = lambda: K.rms_norm_backward(g, x, w, 1e-6, None, None)
bwd_disabled = torch._disable_dynamo(bwd)

lib = torch.library.Library("probe", "DEF")
lib.define("rms(Tensor x, Tensor w, float eps) -> Tensor")
lib.impl("rms", lambda x, w, eps: K.rms_norm(x, None, w, eps)[0], "CUDA")

@torch.library.custom_op("probe2::rms", mutates_args=())
def rms2(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return K.rms_norm(x, None, w, eps)[0]

with torch.no_grad():
    for name, fn in [("K.rms_norm direct", direct), ("K.rms_norm under _disable_dynamo", disabled),
                     ("10 noop launches", noops), ("10 noop launches under _disable_dynamo", noops_disabled),
                     ("K.rms_norm_backward direct", bwd), ("K.rms_norm_backward under _disable_dynamo", bwd_disabled),
                     ("low-level Library op", lambda: torch.ops.probe.rms(x, w, 1e-6)),
                     ("custom_op (default impl)", lambda: rms2(x, w, 1e-6)),
                     ("torch F.rms_norm", lambda: torch.nn.functional.rms_norm(x, (2048,), w, 1e-6))]:
        print(f"{name}: {host_us(fn)} us", flush=True)
