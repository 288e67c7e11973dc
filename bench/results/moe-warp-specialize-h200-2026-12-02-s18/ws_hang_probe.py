"""Why did the warp-specialised GEMM 2 hang on the H200 (this session's second device call), and is a warp-specialised
grouped GEMM faster? mok/kernels/moe/grouped_gemm.py is patched in a temporary copy (mok is not changed) so that
_grouped_gemm_kernel takes a WARP_SPECIALIZE constexpr: 0 as today; 1: its K loop warp-specialised (Triton's
tl.range(warp_specialize=True)) and a program whose tile does not run takes an empty K loop instead of returning early
(Triton 3.6's warp specialisation rejects the early return's branch); 2: warp-specialised, and such a program runs the
full K loop on its (clamped) tile and stores nothing. Each variant runs GEMM 2 of qwen3-30b-a3b at T = 16384 in its
own process under a time limit, checks its output's bits against today's config and times it; a plain
warp-specialised matmul (Triton's own test pattern, device-side descriptors) shows whether warp specialisation runs
at all on this machine.

    PYTHONPATH=. python3 bench/results/moe-warp-specialize-h200-2026-12-02-s18/ws_hang_probe.py --out DIR
    TRITON_INTERPRET=1 PYTHONPATH=. python3 .../ws_hang_probe.py --out DIR --cpu     # the patch's logic, no GPU
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

PATCHES = [
    ("    PDL: tl.constexpr, PREFETCH_K: tl.constexpr, LINE: tl.constexpr,\n):",
     "    PDL: tl.constexpr, PREFETCH_K: tl.constexpr, LINE: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,\n):"),
    ("""        num_experts, pid_m, SCANNED, TOP_K, BLOCK_T, BLOCK_KP, BLOCK_M)
    if runs == 0:
        return
    if A_ROWS == ROWS_POSITION:""", """        num_experts, pid_m, SCANNED, TOP_K, BLOCK_T, BLOCK_KP, BLOCK_M)
    k_stop = k_dim
    if WARP_SPECIALIZE == 1:
        k_stop = tl.where(runs != 0, k_dim, 0)
        mask_m = tl.where(runs != 0, mask_m, False)
    elif WARP_SPECIALIZE == 2:
        mask_m = tl.where(runs != 0, mask_m, False)
        expert = tl.where(runs != 0, expert, 0)
        row_start = tl.where(runs != 0, row_start, 0)
    else:
        if runs == 0:
            return
    if A_ROWS == ROWS_POSITION:"""),
    ("    for k0 in range(0, k_dim, BLOCK_K):\n        mask_k = offs_k < k_dim - k0",
     "    for k0 in tl.range(0, k_stop, BLOCK_K, warp_specialize=WARP_SPECIALIZE > 0):\n"
     "        mask_k = offs_k < k_dim - k0"),
]

TODAY = dict(BLOCK_M=128, BLOCK_N=256, GROUP_M=8, TMA=1, LEAN_EPILOGUE=1, num_warps=8, num_stages=3)
WS = dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, TMA=1, LEAN_EPILOGUE=1, num_warps=4, num_stages=3)
VARIANTS = {  # name: (config, WARP_SPECIALIZE, PDL)
    "today": (TODAY, 0, True),
    "128x128 4 warps, not specialised": (WS, 0, True),
    "specialised, empty loops": (WS, 1, True),
    "specialised, full loops": (WS, 2, True),
    "specialised, full loops, no PDL": (WS, 2, False),
}


def patched_module():
    import mok.kernels.moe.grouped_gemm as original

    src = open(original.__file__).read()
    for old, new in PATCHES:
        assert src.count(old) == 1, old[:80]
        src = src.replace(old, new)
    path = os.path.join(tempfile.mkdtemp(), "grouped_gemm_ws.py")
    open(path, "w").write(src)
    spec = importlib.util.spec_from_file_location("grouped_gemm_ws", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_variant(name, out_dir, cpu):
    import torch

    from mok.kernels import launch
    from mok.kernels.moe import layer
    from mok.kernels.moe.schedule import Schedule

    cfg, ws, pdl = VARIANTS[name]
    launch.PDL_ENABLED = pdl
    device = "cpu" if cpu else "cuda"
    tokens, hidden, inter, experts, top_k = (40, 64, 32, 4, 2) if cpu else (16384, 2048, 768, 128, 8)
    if cpu:
        cfg = dict(cfg, BLOCK_M=16, BLOCK_N=32 if cfg["BLOCK_N"] == 128 else 64)
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(tokens, experts, device=device, generator=gen)
    ids, _, _ = layer.route(logits, top_k, True)
    act = torch.randn(tokens * top_k, inter, device=device, generator=gen).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, device=device, generator=gen) / inter ** 0.5).bfloat16()
    schedule = Schedule(ids, experts, block_m=cfg["BLOCK_M"])
    y = torch.zeros(tokens * top_k, hidden, device=device, dtype=torch.bfloat16)
    gg = patched_module()
    gg.launch_gemm2(act, w2, y, schedule, top_k, dict(cfg, WARP_SPECIALIZE=ws))
    row = {"variant": name, "config": cfg, "WARP_SPECIALIZE": ws, "PDL": pdl}
    if not cpu:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(20):
            start.record()
            gg.launch_gemm2(act, w2, y, schedule, top_k, dict(cfg, WARP_SPECIALIZE=ws))
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        row["ms"] = round(sorted(times)[len(times) // 2], 4)
    reference = os.path.join(out_dir, "today.pt")
    if name == "today":
        torch.save(y.cpu(), reference)
    else:
        row["bits_equal_today"] = bool(torch.equal(torch.load(reference), y.cpu()))
    print(json.dumps(row), flush=True)


def plain_ws_matmul():
    """Triton's own warp-specialised TMA matmul pattern (device-side descriptors), 8192 x 8192 x 512, fp16."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def matmul(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               WS: tl.constexpr):
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
        pid_m = tl.program_id(0) // tl.cdiv(N, BN)
        pid_n = tl.program_id(0) % tl.cdiv(N, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in tl.range(tl.cdiv(K, BK), warp_specialize=WS, num_stages=3):
            acc = tl.dot(a_desc.load([pid_m * BM, k * BK]), b_desc.load([pid_n * BN, k * BK]).T, acc)
        c_desc.store([pid_m * BM, pid_n * BN], acc.to(tl.float16))

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    m = n = 8192
    k = 512
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    b = torch.randn(n, k, device="cuda", dtype=torch.float16)
    for ws in (False, True):
        c = torch.empty(m, n, device="cuda", dtype=torch.float16)
        grid = (triton.cdiv(m, 128) * triton.cdiv(n, 128),)
        compiled = matmul[grid](a, b, c, m, n, k, 128, 128, 64, ws, num_warps=4)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            matmul[grid](a, b, c, m, n, k, 128, 128, 64, ws, num_warps=4)
        end.record()
        torch.cuda.synchronize()
        print(json.dumps({"variant": f"plain matmul, warp_specialize={ws}",
                          "ws_region": "ttg.warp_specialize" in compiled.asm["ttgir"],
                          "ms": round(start.elapsed_time(end) / 10, 4),
                          "max_err_vs_torch": float((c.float() - (a @ b.T).float()).abs().max())}), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--variant")
    parser.add_argument("--limit-s", type=float, default=45.0)
    args = parser.parse_args()
    if args.variant == "plain":
        return plain_ws_matmul()
    if args.variant:
        return run_variant(args.variant, args.out, args.cpu)
    os.makedirs(args.out, exist_ok=True)
    for name in ([] if args.cpu else ["plain"]) + list(VARIANTS):
        cmd = [sys.executable, __file__, "--out", args.out, "--variant", name] + (["--cpu"] if args.cpu else [])
        t0 = time.perf_counter()
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.limit_s)
            rows = [line for line in done.stdout.splitlines() if line.startswith("{")]
            print("\n".join(rows) if rows else json.dumps(
                {"variant": name, "rc": done.returncode, "stderr_tail": done.stderr[-600:]}), flush=True)
        except subprocess.TimeoutExpired:
            print(json.dumps({"variant": name, "hung": f"killed after {args.limit_s} s"}), flush=True)
        print(json.dumps({"variant": name, "wall_s": round(time.perf_counter() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
