"""Host cost of a Triton launch on the H200 machine: JITFunction.run against calling the compiled kernel's
launcher directly, and mok.moe's eager T=1 decode split into its layers (qwen3-30b-a3b shape)."""
import time

import torch
import triton
import triton.language as tl
from triton.runtime import driver


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


@triton.jit
def _noop(a, b, c, d, n, m, k, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    pass


x = torch.randn(64, 64, device="cuda")
args = (x, x, x, x, 64, 64, 64)
compiled = _noop[(1,)](*args, BLOCK=16, FLAG=True)
print("compiled.run signature args: grid0..2, stream, function, packed_metadata, launch_metadata, hooks, *args")
device = torch.cuda.current_device()


def direct():
    stream = driver.active.get_current_stream(device)
    compiled.run(1, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *args, 16, True)


def direct_raw_stream():
    compiled.run(1, 1, 1, torch._C._cuda_getCurrentRawStream(device), compiled.function, compiled.packed_metadata,
                 None, None, None, *args, 16, True)


binder = _noop.device_caches[device][4]
print("binder ->", binder(*args, BLOCK=16, FLAG=True)[1])
for name, fn in [("jit run (kernel[grid](...))", lambda: _noop[(1,)](*args, BLOCK=16, FLAG=True)),
                 ("compiled.run direct", direct), ("compiled.run raw stream", direct_raw_stream),
                 ("binder only", lambda: binder(*args, BLOCK=16, FLAG=True)),
                 ("torch.empty(64)", lambda: torch.empty(64, device="cuda")),
                 ("x.add_(1)", lambda: x.add_(1))]:
    print(f"{name}: {host_us(fn)} us", flush=True)

import mok  # noqa: E402
from mok.kernels import moe as K  # noqa: E402

E, H, I, top_k = 128, 2048, 768, 8
gen = torch.Generator(device="cuda").manual_seed(0)
w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) * 0.02).bfloat16()
w2 = (torch.randn(E, H, I, device="cuda", generator=gen) * 0.02).bfloat16()
h = torch.randn(1, H, device="cuda", generator=gen).bfloat16()
logits = torch.randn(1, E, device="cuda", generator=gen)
with torch.no_grad():
    for name, fn in [("mok.moe T=1", lambda: mok.moe(h, logits, w13, w2, top_k)),
                     ("torch.ops.mok.moe_infer", lambda: torch.ops.mok.moe_infer(h, logits, w13, w2, None, None, top_k,
                                                                                  True)),
                     ("kernels.moe_infer", lambda: K.moe_infer(h, logits, w13, w2, None, None, top_k, True))]:
        print(f"{name}: {host_us(fn)} us", flush=True)
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        K.moe_infer(h, logits, w13, w2, None, None, top_k, True)
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
