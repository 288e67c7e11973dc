import inspect, sys, threading, time, json
import torch
import torch._library.custom_ops as co
src = inspect.getsource(co.CustomOpDef.register_kernel)
i = src.find("def backend_impl")
print(src[i:i+1500])
import mok
from mok.kernels import rms_norm as K
print("threads", [t.name for t in threading.enumerate()])

@torch.library.custom_op("probe::clone", mutates_args=())
def probe_clone(x: torch.Tensor) -> torch.Tensor:
    return x.clone()

@probe_clone.register_kernel("cuda")
def _(x):
    return x.clone()

@torch.library.custom_op("probe::clone2", mutates_args=())
def probe_clone2(x: torch.Tensor) -> torch.Tensor:
    return x.clone()

x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
w = torch.ones(2048, device="cuda", dtype=torch.bfloat16)

def host_us(fn, n=200):
    for _ in range(5): fn()
    torch.cuda.synchronize()
    s = time.perf_counter()
    for _ in range(n): fn()
    h = (time.perf_counter() - s) / n * 1e6
    torch.cuda.synchronize()
    return round(h, 1)

cases = {
    "torch clone": lambda: x.clone(),
    "custom op, cuda kernel": lambda: probe_clone(x),
    "custom op, default impl": lambda: probe_clone2(x),
    "torch.ops.probe.clone direct": lambda: torch.ops.probe.clone(x),
    "mok.rms_norm no_grad": lambda: mok.rms_norm(x, w, 1e-6),
    "kernels.rms_norm direct": lambda: K.rms_norm(x, None, w, 1e-6),
    "F.rms_norm": lambda: torch.nn.functional.rms_norm(x, (2048,), w, 1e-6),
}
with torch.no_grad():
    for name, fn in cases.items():
        print(name, host_us(fn), "us host", flush=True)
sys.setswitchinterval(1e-6)
with torch.no_grad():
    print("switchinterval 1us: custom op cuda", host_us(cases["custom op, cuda kernel"]), "mok.rms_norm", host_us(cases["mok.rms_norm no_grad"]))
sys.setswitchinterval(0.005)
xg = x.clone().requires_grad_()
g = torch.randn_like(x)
def fb():
    xg.grad = None
    mok.rms_norm(xg, w, 1e-6).backward(g)
print("mok.rms_norm fwd+bwd", host_us(fb, 50))
from torch.profiler import profile, ProfilerActivity
for name, fn in (("custom op cuda", lambda: probe_clone(x)), ("mok fwd+bwd", fb)):
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(20): fn()
        torch.cuda.synchronize()
    print("==", name)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
