"""Interpreter cases of verify's Triton row-digest kernel (run through the `triton_interpret` fixture of
tests/conftest.py; the harness: tests/helpers/interpret.py): the kernel, run by the interpreter on CPU
tensors, against the CPU path over tiny shapes of every dtype, strided views and forced multi-chunk plans."""
import sys

from tests.helpers.interpret import Cases, run_cases

CASES = Cases()


def _inputs():
    import torch

    gen = torch.Generator().manual_seed(0)
    for dtype in [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8,
                  torch.int16, torch.int32, torch.int64, torch.bool]:
        for shape in [(5, 13), (3, 8), (2, 3, 7), (), (1,), (6,), (4, 0), (0, 3)]:
            x = torch.randn(shape, generator=gen) * 100
            yield x > 0 if dtype == torch.bool else x.to(dtype)
    base = torch.randn(9, 24, generator=gen)
    yield base.bfloat16()[:, ::3]          # strided columns: packed path
    yield base.bfloat16()[1:, 4:]          # contiguous rows, row stride not a multiple of 8 bytes
    yield base.bfloat16()[:, 8:]           # contiguous, aligned rows: direct int64 words
    yield base.t()                         # transposed fp32
    yield base[:1].expand(4, 24)           # zero row stride


@CASES.case
def triton_row_digests_match_cpu():
    import torch

    from verify.fingerprints import bits_view, row_digests_async, tag_key
    from verify.fingerprints_triton import row_digests_triton

    checked, mismatches = 0, []
    for x in _inputs():
        bits = bits_view(x)
        key = tag_key(x.dtype, bits.shape[1])
        want = row_digests_async(x)
        n_words = (bits.shape[1] * bits.element_size() + 7) // 8
        if not (bits.shape[0] and n_words):
            continue  # no kernel runs for empty rows (row_digests_async fills them on the device)
        plans = [None]
        if True:
            plans.append({"block_r": 2, "block_w": 1, "n_chunks": n_words, "words_per_chunk": 1})
            plans.append({"block_r": 1, "block_w": 2, "n_chunks": (n_words + 1) // 2, "words_per_chunk": 2})
        for plan in plans:
            got = row_digests_triton(bits, key, plan_override=plan)
            checked += 1
            if not torch.equal(got, want):
                mismatches.append(f"mismatch dtype={x.dtype} shape={tuple(x.shape)} stride={x.stride()} plan={plan}")
    assert not mismatches, "\n".join(mismatches)
    assert checked > 100, checked


if __name__ == "__main__":
    sys.exit(run_cases(CASES))
