"""Digests of every public mok op's outputs and gradients on fixed random inputs: run it with two versions of
mok on the same GPU (e.g. the last landed commit and the working tree) and compare the JSON files, to show a
change kept every bit. Uses only the public ops, positionally (mok.moe, route, linear, rms_norm, rotary,
silu_and_mul, log_softmax, logprobs, attention, paged_attention, write_kv_cache), so that older checkouts run it too.
bench/results/digests-latest.json holds the current tree's digests on the H200.

    PYTHONPATH=<a mok checkout> python bench/op_digests.py --out digests.json
    python bench/op_digests.py --compare before.json after.json     # exit 1 when a digest differs
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the reference ops (a dry run)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def randn(*shape, seed: int, dtype=torch.bfloat16, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(dtype)


def moe_digests(out: dict) -> None:
    import mok

    for name, (hidden, inter, experts, top_k), tokens in (("mixtral", (4096, 1024, 8, 2), (1, 37, 300)),
                                                            ("qwen3", (2048, 768, 128, 8), (1, 37, 2100)),
                                                            ("olmoe", (2048, 1024, 64, 8), (5, 3000))):
        w13 = randn(experts, 2 * inter, hidden, seed=1, scale=hidden ** -0.5).requires_grad_()
        w2 = randn(experts, hidden, inter, seed=2, scale=inter ** -0.5).requires_grad_()
        for num_tokens in tokens:
            x = randn(num_tokens, hidden, seed=3 + num_tokens).requires_grad_()
            logits = randn(num_tokens, experts, seed=4 + num_tokens).requires_grad_()
            with torch.no_grad():
                out[f"moe {name} T{num_tokens} infer"] = digest(mok.moe(x, logits, w13, w2, top_k))
            y = mok.moe(x, logits, w13, w2, top_k)
            y.backward(randn(num_tokens, hidden, seed=5))
            for label, t in (("y", y), ("dx", x.grad), ("dlogits", logits.grad), ("dw13", w13.grad), ("dw2", w2.grad)):
                out[f"moe {name} T{num_tokens} {label}"] = digest(t)
            w13.grad = w2.grad = None
            ids, weights = mok.route(logits.detach(), top_k)
            out[f"route {name} T{num_tokens}"] = digest(ids) + digest(weights)


def dense_digests(out: dict) -> None:
    import mok

    for tokens in (1, 77, 4096):
        x = randn(tokens, 2048, seed=10 + tokens).requires_grad_()
        w = randn(5120, 2048, seed=11, scale=0.02).requires_grad_()
        y = mok.linear(x, w)
        y.backward(randn(*y.shape, seed=12))
        out[f"linear T{tokens}"] = digest(y) + digest(x.grad) + digest(w.grad)
        norm_w = (1 + 0.1 * randn(2048, seed=13, dtype=torch.float32)).bfloat16().requires_grad_()
        residual = randn(tokens, 2048, seed=14)
        normed, summed = mok.rms_norm(x.detach(), norm_w, 1e-6, residual)
        out[f"rms_norm+residual T{tokens}"] = digest(normed) + digest(summed)
        xr = x.detach().clone().requires_grad_()
        yr = mok.rms_norm(xr, norm_w, 1e-6)
        yr.backward(randn(*yr.shape, seed=15))
        out[f"rms_norm T{tokens}"] = digest(yr) + digest(xr.grad) + digest(norm_w.grad)
        q = randn(tokens, 32, 128, seed=16).requires_grad_()
        positions = torch.arange(tokens, device=DEVICE) * 3 + 5
        yq = mok.rotary(q, positions, 1e6)
        yq.backward(randn(*yq.shape, seed=17))
        out[f"rotary T{tokens}"] = digest(yq) + digest(q.grad)
        gu = randn(tokens, 2 * 768, seed=18).requires_grad_()
        ys = mok.silu_and_mul(gu)
        ys.backward(randn(*ys.shape, seed=19))
        out[f"silu_and_mul T{tokens}"] = digest(ys) + digest(gu.grad)
        logits = randn(min(tokens, 512), 151936, seed=20, dtype=torch.float32).requires_grad_()
        ids = torch.randint(0, 151936, (logits.shape[0],), device=DEVICE,
                            generator=torch.Generator(DEVICE).manual_seed(21))
        lp = mok.logprobs(logits, ids)
        lp.sum().backward()
        out[f"logprobs T{tokens}"] = digest(lp) + digest(logits.grad) + digest(mok.log_softmax(logits.detach()))


def attention_digests(out: dict) -> None:
    import mok

    lens = [1, 300, 2049, 64]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q = randn(sum(lens), 32, 128, seed=30).requires_grad_()
    k, v = randn(sum(lens), 4, 128, seed=31).requires_grad_(), randn(sum(lens), 4, 128, seed=32).requires_grad_()
    o = mok.attention(q, k, v, cu, cu, 128 ** -0.5)
    o.backward(randn(*o.shape, seed=33))
    out["attention"] = digest(o) + digest(q.grad) + digest(k.grad) + digest(v.grad)
    page = 16
    pages = sum(-(-n // page) for n in lens)
    key_cache = torch.zeros(pages + 3, page, 4, 128, dtype=torch.bfloat16, device=DEVICE)
    value_cache = torch.zeros_like(key_cache)
    perm = torch.randperm(pages + 3, generator=torch.Generator().manual_seed(34))[:pages].tolist()
    table = torch.zeros(len(lens), max(-(-n // page) for n in lens), dtype=torch.int32)
    slots, used = [], 0
    for b, n in enumerate(lens):
        count = -(-n // page)
        table[b, :count] = torch.tensor(perm[used:used + count])
        slots += [int(table[b, i // page]) * page + i % page for i in range(n)]
        used += count
    mok.write_kv_cache(k.detach(), v.detach(), key_cache, value_cache, torch.tensor(slots, device=DEVICE))
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    for decode in (False, True):
        paged = mok.paged_attention(q.detach(), key_cache, value_cache, cu, seq_lens, table.to(DEVICE), 128 ** -0.5,
                                    decode=decode)
        out[f"paged_attention decode={decode}"] = digest(paged)
    out["paged == packed"] = str(torch.equal(paged, o.detach()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out")
    parser.add_argument("--compare", nargs=2)
    args = parser.parse_args()
    if args.compare:
        before, after = (json.load(open(p)) for p in args.compare)
        differ = sorted(k for k in before if k in after and before[k] != after[k])
        missing = sorted(set(before) ^ set(after))
        print(json.dumps(dict(compared=len(set(before) & set(after)), differ=differ, only_in_one=missing)))
        return 1 if differ else 0
    out: dict[str, str] = {}
    for part in (moe_digests, dense_digests, attention_digests):
        part(out)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=0, sort_keys=True)
    print(f"{len(out)} digests -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
