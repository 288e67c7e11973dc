import time
import torch
import mok
import mok.ops.rms_norm as R
from mok.ops import checks
from mok.kernels import rms_norm as K

def host_us(fn, n=300):
    for _ in range(10): fn()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(3):
        s = time.perf_counter()
        for _ in range(n): fn()
        best = min(best, (time.perf_counter() - s) / n * 1e6)
        torch.cuda.synchronize()
    return round(best, 2)

x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
w = torch.ones(2048, device="cuda", dtype=torch.bfloat16)
shape = x.shape
cases = [
    ("empty loop", lambda: None),
    ("check_tensor", lambda: checks.check_tensor(x, "a")),
    ("dtype in", lambda: x.dtype in checks.FLOAT_DTYPES),
    ("x.shape[-1]", lambda: x.shape[-1]),
    ("tuple(w.shape) != ...", lambda: tuple(w.shape) != (x.shape[-1],)),
    ("check_device(x, w)", lambda: checks.check_device(x, w)),
    ("x.device", lambda: x.device),
    ("check_real", lambda: checks.check_real(1e-6, "e", nonnegative=True)),
    ("hooks.observed", lambda: mok.hooks.observed()),
    ("x.reshape(-1, F)", lambda: x.reshape(-1, shape[-1])),
    ("x.contiguous()", lambda: x.contiguous()),
    ("x.stride(-1)", lambda: x.stride(-1)),
    ("torch.empty", lambda: torch.empty(4096, 2048, dtype=x.dtype, device=x.device)),
    ("torch.compiler.is_compiling", lambda: torch.compiler.is_compiling()),
    ("K.rms_norm", lambda: K.rms_norm(x, None, w, 1e-6)),
    ("R._rms_norm_cuda", lambda: R._rms_norm_cuda(x, w, 1e-6)),
    ("torch.ops.mok.rms_norm.default", lambda: torch.ops.mok.rms_norm.default(x, w, 1e-6)),
    ("R._rms_norm_op", lambda: R._rms_norm_op(x, w, 1e-6)),
    ("mok.rms_norm", lambda: mok.rms_norm(x, w, 1e-6)),
]
with torch.no_grad():
    for name, fn in cases:
        print(f"{name}: {host_us(fn)} us", flush=True)
print("grad mode on, mok.rms_norm", host_us(lambda: mok.rms_norm(x, w, 1e-6)))
