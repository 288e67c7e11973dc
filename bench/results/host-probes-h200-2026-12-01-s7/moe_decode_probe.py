"""Host microseconds of mok.moe's eager T=1 decode (qwen3-30b-a3b shape) split into its steps, with mok's cached
launch path and with Triton's own launch; rms_norm forward+backward beside F.rms_norm. Best of 3 means."""
import time

import torch
import torch.nn.functional as F

import mok
from mok.kernels import launch
from mok.kernels.moe import configs, layer
from mok.kernels.moe.combine import launch_combine
from mok.kernels.moe.grouped_gemm import launch_gemm1, launch_gemm2
from mok.kernels.moe.routing import launch_route
from mok.kernels.moe.schedule import ScannedRoutes


def host_us(fn, n=400):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(3):
        s = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - s) / n * 1e6)
        torch.cuda.synchronize()
    return round(best, 1)


E, H, I, top_k = 128, 2048, 768, 8
gen = torch.Generator(device="cuda").manual_seed(0)
w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) * 0.02).bfloat16()
w2 = (torch.randn(E, H, I, device="cuda", generator=gen) * 0.02).bfloat16()
h = torch.randn(1, H, device="cuda", generator=gen).bfloat16()
logits = torch.randn(1, E, device="cuda", generator=gen)
cfg = configs.pick_configs(top_k, E)
pieces = [((top_k, I), torch.bfloat16), ((top_k, H), torch.bfloat16), ((0,), torch.int32),
          ((1, top_k), torch.float32), ((1, E), torch.float32), ((1, top_k), torch.int32)]
act, y, _, weights, probs, ids = layer._workspace(h.device, pieces)
out = torch.empty(1, H, device="cuda", dtype=torch.bfloat16)
launch_route(logits, top_k, True, None, out=(ids, weights, probs))
routes = ScannedRoutes(ids, E)
x = torch.randn(4096, 2048, device="cuda").bfloat16()
w = torch.ones(2048, device="cuda").bfloat16()
xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
g = torch.randn_like(x)


def fwd_bwd(fn):
    def run():
        xl.grad = wl.grad = None
        fn().backward(g)
    return run


steps = [("workspace (1 empty, 6 views)", lambda: layer._workspace(h.device, pieces)),
         ("pick_configs", lambda: configs.pick_configs(top_k, E)),
         ("ScannedRoutes", lambda: ScannedRoutes(ids, E)),
         ("launch_route", lambda: launch_route(logits, top_k, True, None, out=(ids, weights, probs))),
         ("launch_gemm1", lambda: launch_gemm1(h, w13, routes, top_k, False, cfg["gemm1"], act_NI=act)),
         ("launch_gemm2", lambda: launch_gemm2(act, w2, y, routes, top_k, cfg["gemm2"])),
         ("launch_combine", lambda: launch_combine(y, weights, out, top_k, ids, E)),
         ("kernels.moe_infer", lambda: layer.moe_infer(h, logits, w13, w2, None, None, top_k, True)),
         ("mok.moe (no grad)", lambda: mok.moe(h, logits, w13, w2, top_k)),
         ("mok.rms_norm fwd+bwd T=4096", fwd_bwd(lambda: mok.rms_norm(xl, wl, 1e-6))),
         ("F.rms_norm fwd+bwd T=4096", fwd_bwd(lambda: F.rms_norm(xl, (2048,), wl, 1e-6))),
         ("mok.rms_norm fwd (no grad)", lambda: mok.rms_norm(x, w, 1e-6)),
         ("F.rms_norm fwd (no grad)", lambda: F.rms_norm(x, (2048,), w, 1e-6))]
with torch.no_grad():
    for cached in (True, False):
        launch.CACHED_LAUNCH_ENABLED = cached
        for name, fn in steps:
            if "bwd" in name:
                with torch.enable_grad():
                    us = host_us(fn, 200)
            else:
                us = host_us(fn)
            print(f"{'cached' if cached else 'triton'} launch | {name}: {us} us", flush=True)
