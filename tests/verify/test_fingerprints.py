"""verify fingerprints: exactness (every bit counts), layout independence, dtype/shape coverage,
agreement with an independent reference, the Triton kernel under the interpreter, and CPU == CUDA."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import verify
from tests.helpers import reference
from verify.errors import UnsupportedDtypeError

REPO = Path(__file__).resolve().parents[2]
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool]


def sample(shape, dtype, seed=0):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 50
    return x > 0 if dtype == torch.bool else x.to(dtype)


def flip_bit(x: torch.Tensor, flat_index: int, bit: int) -> torch.Tensor:
    y = x.clone()
    as_u8 = y.reshape(-1).view(torch.uint8)
    byte = flat_index * x.element_size() + bit // 8
    as_u8[byte] ^= 1 << (bit % 8)
    return y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 13), (2, 3, 7), (), (9,), (0, 4), (4, 0)])
def test_matches_independent_reference(shape, dtype):
    x = sample(shape, dtype)
    assert verify.row_fingerprints(x).tolist() == reference.row_digests(x)
    assert verify.fingerprint(x) == reference.fingerprint(x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int32])
def test_every_single_bit_flip_changes_row_and_tensor_digest(dtype):
    x = sample((5, 123), dtype)
    base_fp, base_rows = verify.fingerprint(x), verify.row_fingerprints(x)
    nbits = x.element_size() * 8
    for flat_index in [0, 61, 122, 123, 400, 5 * 123 - 1]:
        row = flat_index // 123
        for bit in range(nbits):
            y = flip_bit(x, flat_index, bit)
            rows = verify.row_fingerprints(y)
            assert verify.fingerprint(y) != base_fp, (flat_index, bit)
            changed = (rows != base_rows).nonzero().flatten().tolist()
            assert changed == [row], (flat_index, bit, changed)


def test_bool_flip_changes_digest():
    x = sample((3, 11), torch.bool)
    y = x.clone()
    y[2, 10] = ~y[2, 10]
    assert verify.fingerprint(x) != verify.fingerprint(y)
    assert (verify.row_fingerprints(x) != verify.row_fingerprints(y)).tolist() == [False, False, True]


def test_signed_zero_and_nan_payloads_differ():
    zeros = torch.zeros(4)
    neg = zeros.clone()
    neg[2] = -0.0
    assert torch.equal(zeros, neg)  # equal as numbers ...
    assert verify.fingerprint(zeros) != verify.fingerprint(neg)  # ... but not bitwise
    nan_a = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    nan_b = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert nan_a.isnan().all() and nan_b.isnan().all()
    assert verify.fingerprint(nan_a) != verify.fingerprint(nan_b)
    assert verify.fingerprint(nan_a) == verify.fingerprint(nan_a.clone())


def test_views_equal_contiguous_copies():
    base = sample((12, 10), torch.float32)
    views = [base.t(), base[:, ::3], base[2:7, 1:], base[:1].expand(5, 10), base.reshape(3, 4, 10).transpose(0, 1),
             base.bfloat16()[:, 3:], base.bfloat16()[1:, 4:]]
    for view in views:
        assert not view.is_contiguous() or view.storage_offset() != 0
        copy = view.contiguous()
        assert verify.fingerprint(view) == verify.fingerprint(copy)
        assert torch.equal(verify.row_fingerprints(view), verify.row_fingerprints(copy))


def test_dtype_and_shape_change_the_digest():
    bits = sample((4, 6), torch.int16)
    same_bits = [bits, bits.view(torch.bfloat16), bits.view(torch.float16), bits.view(torch.uint16)]
    assert len({verify.fingerprint(t) for t in same_bits}) == len(same_bits)
    # Same bytes under a different element width also change the row digests themselves.
    assert not torch.equal(verify.row_fingerprints(bits), verify.row_fingerprints(bits.view(torch.bfloat16)))
    shapes = [(4, 6), (6, 4), (24,), (2, 12), (2, 2, 6), (1, 24), (24, 1)]
    assert len({verify.fingerprint(bits.reshape(s)) for s in shapes}) == len(shapes)
    empties = [torch.zeros(s) for s in [(0,), (0, 3), (3, 0), (0, 0), (1, 0)]] + [torch.zeros(())]
    assert len({verify.fingerprint(t) for t in empties}) == len(empties)


def test_row_digests_are_batch_invariant_and_shaped():
    x = sample((2, 3, 7), torch.bfloat16)
    rows = verify.row_fingerprints(x)
    assert rows.dtype == torch.uint64 and rows.device.type == "cpu" and rows.shape == (6,)
    flat = x.reshape(6, 7)
    for i in range(6):
        assert verify.row_fingerprints(flat[i:i + 1]).item() == rows[i].item()
    assert verify.row_fingerprints(flat.flip(0)).tolist() == rows.tolist()[::-1]
    # A repeated row gets the same digest wherever it sits; different rows different digests.
    twice = torch.cat([flat, flat[2:3]])
    digests = verify.row_fingerprints(twice)
    assert digests[6] == digests[2] and len(set(digests[:6].tolist())) == 6
    assert verify.row_fingerprints(torch.tensor(3.0)).shape == (1,)


def test_same_digest_across_processes():
    code = ("import torch, verify; g = torch.Generator().manual_seed(7); "
            "x = torch.randn(33, 17, generator=g).bfloat16(); "
            "print(verify.fingerprint(x), verify.row_fingerprints(x)[5].item())")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    outs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
            for _ in range(2)]
    x = torch.randn(33, 17, generator=torch.Generator().manual_seed(7)).bfloat16()
    here = f"{verify.fingerprint(x)} {verify.row_fingerprints(x)[5].item()}\n"
    assert outs[0] == outs[1] == here


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2])
def test_other_dtypes_match_reference(dtype):
    x = torch.arange(15).reshape(3, 5).to(dtype)
    assert verify.row_fingerprints(x).tolist() == reference.row_digests(x)
    assert verify.fingerprint(x) == reference.fingerprint(x)


def test_unsupported_dtype_is_a_typed_error():
    with pytest.raises(UnsupportedDtypeError, match="complex64"):
        verify.fingerprint(torch.zeros(3, dtype=torch.complex64))


def test_triton_kernel_under_interpreter_matches_cpu(triton_interpret):
    # the kernel against the CPU path, every mismatch listed, and more than 100 (tensor, plan) pairs checked
    verdicts = triton_interpret.verdicts(REPO / "tests/helpers/fingerprints_interpret.py")
    assert verdicts.get("triton_row_digests_match_cpu") == "ok", verdicts


@pytest.mark.gpu
def test_cuda_digests_equal_cpu_digests():
    shapes = [(5, 123), (7,), (), (0, 3), (3, 0), (16384, 2048), (1, 3_000_001), (4096, 1, 33), (64, 4096)]
    checked = 0
    for dtype in DTYPES:
        for shape in shapes:
            x = sample(shape, dtype)
            views = [x]
            if x.dim() == 2 and x.shape[1] > 3 and x.numel() < 10**6:
                views += [x[:, 1:], x[:, ::2]]
            for view in views:
                cpu_rows = verify.row_fingerprints(view)
                cuda_rows = verify.row_fingerprints(view.cuda())
                assert torch.equal(cuda_rows, cpu_rows), (dtype, tuple(view.shape), view.stride())
                assert verify.fingerprint(view.cuda()) == verify.fingerprint(view)
                checked += 1
    print(f"cuda == cpu for {checked} tensors")
    assert checked >= len(DTYPES) * len(shapes)
