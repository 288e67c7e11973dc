"""Benchmark: device fingerprint throughput vs device copy bandwidth, and the cost of recording every
MoE layer's input and output for a Qwen3-30B-A3B-like stack.

    PYTHONPATH=. python3 bench/fingerprint.py --out $OUT/fingerprint.json        (H200)
    PYTHONPATH=. python3 bench/fingerprint.py --device cpu --quick --out /tmp/f.json  (smoke test)

Writes JSON lines (one per measurement, the first describes the machine) and prints them.
Shapes: docs/shapes.md.

- copy: dst.copy_(src) on the device; GB/s counted as read + write (2 * bytes / time), the way the
  H200's ~4.3 TB/s is quoted. fingerprint: the row-digest kernel (what recording runs on the device);
  GB/s = tensor bytes / time (it only reads). ratio_vs_copy = fingerprint GB/s / copy GB/s.
- record: L layers x (input [T, H] + output [T, H]) bf16 recorded with row digests, plus step() (digests
  to the host, xxh3, one SQLite transaction). The reference is the same run's time for the stack's
  expert GEMMs as dense bf16 matmuls of equal FLOPs (a lower bound on any MoE forward:
  [T*K, H] @ [H, 2I] and [T*K, I] @ [I, H] per layer), and the forward time implied by a fixed
  torch._grouped_mm forward rate (GROUPED_MM_FWD_TFLOPS, 179 TFLOP/s at T=16384 on the H200; bench/moe.py
  measures the baseline in its own run: docs/performance.md).
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

import verify
from verify.fingerprints import row_digests_async

SHAPES = [  # name, shape, dtype
    ("hidden", (16384, 2048), torch.bfloat16),
    ("hidden-large", (65536, 4096), torch.bfloat16),
    ("hidden-fp32", (16384, 2048), torch.float32),
    ("odd-rows", (16384, 2047), torch.bfloat16),  # rows not 8-byte multiples: packed in registers
    ("flat-1d", (1 << 28,), torch.bfloat16),       # one row: split into chunks across the device
    ("logits", (2048, 151936), torch.bfloat16),
]
QUICK_SHAPES = [("hidden", (256, 128), torch.bfloat16), ("odd-rows", (64, 127), torch.bfloat16),
                ("flat-1d", (1 << 14,), torch.float32)]
QWEN3 = {"name": "qwen3-30b-a3b", "layers": 48, "T": 16384, "H": 2048, "I": 768, "K": 8}
GROUPED_MM_FWD_TFLOPS = 179.0  # the assumed grouped_mm forward rate, qwen3-30b-a3b, T=16384 (see above)


def timed(fn, device: torch.device, iters: int, warmup: int = 3) -> float:
    """Median seconds per call of fn (CUDA events on the device, wall clock on the CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def machine(device: torch.device) -> dict:
    info = {"kind": "machine", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "python": platform.python_version(), "torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        import triton

        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, sms=props.multi_processor_count, triton=triton.__version__,
                    cuda=torch.version.cuda)
    return info


def bench_throughput(device: torch.device, shapes, iters: int) -> list[dict]:
    out = []
    for name, shape, dtype in shapes:
        x = torch.randn(shape, device=device).to(dtype)
        dst = torch.empty_like(x)
        nbytes = x.numel() * x.element_size()
        t_copy = timed(lambda: dst.copy_(x), device, iters)
        t_fp = timed(lambda: row_digests_async(x), device, iters)
        t_full = timed(lambda: verify.fingerprint(x), device, max(3, iters // 4))
        copy_gbps = 2 * nbytes / t_copy / 1e9
        fp_gbps = nbytes / t_fp / 1e9
        check = x[:64] if x.dim() > 1 else x[:4096]
        out.append({
            "kind": "throughput", "name": name, "shape": list(shape), "dtype": str(dtype).removeprefix("torch."),
            "bytes": nbytes, "copy_ms": t_copy * 1e3, "copy_GBps_rw": copy_gbps,
            "fingerprint_ms": t_fp * 1e3, "fingerprint_GBps": fp_gbps,
            "ratio_vs_copy": fp_gbps / copy_gbps, "ratio_vs_copy_read": fp_gbps / (copy_gbps / 2),
            "fingerprint_end_to_end_ms": t_full * 1e3,
            "cpu_digests_match": bool(torch.equal(verify.row_fingerprints(check),
                                                  verify.row_fingerprints(check.cpu()))),
        })
        print(json.dumps(out[-1]), flush=True)
        x = dst = None  # free before the next shape
    return out


def bench_recording(device: torch.device, cfg: dict, iters: int) -> list[dict]:
    num_layers, T, H, I, K = cfg["layers"], cfg["T"], cfg["H"], cfg["I"], cfg["K"]
    gen = torch.Generator(device=device).manual_seed(0)
    acts = [(torch.randn(T, H, device=device, generator=gen).bfloat16(),
             torch.randn(T, H, device=device, generator=gen).bfloat16()) for _ in range(num_layers)]
    # Reference: the layer stack's expert GEMMs as dense bf16 matmuls of the same FLOPs.
    x_NH = torch.randn(T * K, H, device=device, generator=gen).bfloat16()
    w13_H2I = torch.randn(H, 2 * I, device=device, generator=gen).bfloat16()
    w2_IH = torch.randn(I, H, device=device, generator=gen).bfloat16()
    act_NI = torch.empty(T * K, I, device=device, dtype=torch.bfloat16)

    def gemms_one_layer():
        act_NI.copy_((x_NH @ w13_H2I)[:, :I])
        return act_NI @ w2_IH

    t_gemm_layer = timed(gemms_one_layer, device, max(3, iters // 2))
    flops_layer = 6 * T * K * H * I
    t_stack_gemm = t_gemm_layer * num_layers
    t_stack_grouped_mm = flops_layer * num_layers / (GROUPED_MM_FWD_TFLOPS * 1e12)
    x_NH = w13_H2I = w2_IH = act_NI = None

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for rows in (True, False):
            samples = {"record_calls": [], "device": [], "step": [], "total": []}
            for i in range(iters + 1):
                rec = verify.Recorder(Path(tmp) / f"trace-{rows}-{i}.db", run="bench", rows=rows)
                sync(device)
                t0 = time.perf_counter()
                for layer, (in_TH, out_TH) in enumerate(acts):
                    rec.record(f"layers.{layer}.moe", in_TH, kind="input")
                    rec.record(f"layers.{layer}.moe", out_TH, kind="output")
                t1 = time.perf_counter()
                sync(device)
                t2 = time.perf_counter()
                rec.step(param_grads=False)
                t3 = time.perf_counter()
                rec.close()
                if i == 0:
                    continue  # warm-up (kernel compilation)
                for key, value in (("record_calls", t1 - t0), ("device", t2 - t0), ("step", t3 - t2),
                                   ("total", t3 - t0)):
                    samples[key].append(value)
            med = {key: statistics.median(v) for key, v in samples.items()}
            nbytes = 2 * num_layers * T * H * 2
            results.append({
                "kind": "record", "model": cfg["name"], "layers": num_layers, "tokens": T, "hidden": H, "rows": rows,
                "tensors": 2 * num_layers, "bytes": nbytes,
                "record_calls_ms": med["record_calls"] * 1e3, "device_ms": med["device"] * 1e3,
                "step_ms": med["step"] * 1e3, "total_ms": med["total"] * 1e3,
                "device_GBps": nbytes / med["device"] / 1e9,
                "stack_expert_gemm_ms": t_stack_gemm * 1e3,
                "overhead_vs_expert_gemms": med["total"] / t_stack_gemm,
                "stack_grouped_mm_forward_ms_design": t_stack_grouped_mm * 1e3,
                "overhead_vs_grouped_mm_forward": med["total"] / t_stack_grouped_mm,
            })
            print(json.dumps(results[-1]), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON lines output file")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test only)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/fingerprint.py: no CUDA device (use --device cpu --quick for a smoke test)")
    shapes = QUICK_SHAPES if args.quick else SHAPES
    cfg = {**QWEN3, "layers": 4, "T": 64, "H": 128, "I": 32, "K": 2} if args.quick else QWEN3
    iters = 3 if args.quick else args.iters
    lines = [machine(device)]
    print(json.dumps(lines[0]), flush=True)
    lines += bench_throughput(device, shapes, iters)
    lines += bench_recording(device, cfg, max(3, iters // 4))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps(line) + "\n" for line in lines))


if __name__ == "__main__":
    main()
