"""mok.rotary's cached cos/sin table (mok/kernels/rotary.py) keeps the bits of the per-token fp64 formula.

Interpreter cases (TRITON_INTERPRET=1, one child process: tests/helpers/interpret.py) run the CUDA code
path on CPU tensors and compare it bitwise with the kernel as it was before the table
(tests/helpers/rotary_per_token.py): forward (inverse=False) and backward (inverse=True, the rotation
mok.rotary's autograd applies to the gradient), at positions 0, 1, 4095, 32767, 131071 and around them,
bf16 / fp16 / fp32, odd head counts, full and partial rotary dims, both styles; with the table covering
every position, with the default table (the far positions then take the per-token branch), without the
table, and after the table grew. Under the interpreter both kernels run the same numpy code for each
operation (bf16 casts included), so equal bits here prove equal logic; tests/mok/test_dense_gpu.py
checks the same on the GPU (libdevice's fp64 cos/sin, FMA contraction).
The size rule (sizes only, no positions read) runs in plain pytest.
"""
from __future__ import annotations

import functools
import sys

import pytest
import torch

from tests.helpers.interpret import Cases, interpreter_test, run_cases

CASES = Cases()
POSITIONS = [0, 1, 2, 4095, 4096, 32767, 32768, 65535, 131071, 131072, 200000, 2**24 + 1, -3]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (heads, head_dim, rotary_dim, theta)
SHAPES = [(5, 64, 64, 1e6), (3, 40, 24, 1e4)]


def _inputs(heads, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    positions = torch.tensor(POSITIONS, dtype=torch.int64)
    return torch.randn(len(POSITIONS), heads, head_dim, generator=g).to(dtype), positions


def _assert_same_bits(got, want, label):
    assert got.dtype == want.dtype and got.shape == want.shape, label
    same = got.view(torch.uint8 if got.element_size() == 1 else {2: torch.int16, 4: torch.int32}[got.element_size()])
    ref = want.view(same.dtype)
    bad = (same != ref).reshape(got.shape[0], -1).any(-1).nonzero().flatten().tolist()
    assert not bad, f"{label}: positions {[POSITIONS[i] for i in bad]} differ"


@functools.cache
def _table_131072(theta, rotary_dim):
    """The table of 131072 rows, built once per (theta, rotary_dim) in this process (the interpreter runs a
    program in about a millisecond: a build takes seconds)."""
    from mok.kernels import rotary as kernels

    return kernels.build_cos_sin_table(kernels._inv_freq(theta, rotary_dim, torch.device("cpu")), 131072)


def table_equals_per_token(dtype, neox, shape):
    from mok.kernels import rotary as kernels
    from tests.helpers import rotary_per_token as before

    heads, head_dim, rotary_dim, theta = shape
    x, positions = _inputs(heads, head_dim, dtype)
    key = (theta, rotary_dim, None, x.device)
    for inverse in (False, True):
        want = before.rotary(x, positions, theta, rotary_dim, neox, inverse)
        label = f"inverse={inverse}"
        kernels.clear_tables()
        # the default table (4096 rows for 13 tokens): positions from 4096 on take the per-token branch
        _assert_same_bits(kernels.rotary(x, positions, theta, rotary_dim, neox, inverse), want, f"default {label}")
        assert kernels._TABLE_CACHE[key].shape[0] == 4096
        # a table covering 0..131071 (131072 and beyond, and -3, still per token); the call would build it
        kernels._TABLE_CACHE[key] = _table_131072(theta, rotary_dim)
        _assert_same_bits(kernels.rotary(x, positions, theta, rotary_dim, neox, inverse, max_positions=131072), want,
                          f"table of 131072 rows {label}")
        assert kernels._TABLE_CACHE[key] is _table_131072(theta, rotary_dim)
        _assert_same_bits(kernels.rotary(x, positions, theta, rotary_dim, neox, inverse, use_table=False), want,
                          f"no table {label}")
        if rotary_dim < head_dim:
            assert torch.equal(want[..., rotary_dim:], x[..., rotary_dim:])


CASES.parametrize(table_equals_per_token, dtype=DTYPES, neox=[True, False], shape=SHAPES)


@CASES.case
def table_entries_are_the_per_token_cos_sin():
    """Rotating (1, 0) in fp32 gives (cos, sin) exactly: the old kernel's cos/sin equal the table's rows."""
    from mok.kernels import rotary as kernels
    from tests.helpers import rotary_per_token as before

    for theta, rotary_dim, rows in ((1e4, 24, 70000), (1e6, 128, 5000), (500000.0, 2, 5000)):
        half = rotary_dim // 2
        positions = torch.cat([torch.arange(0, rows, 613), torch.tensor([1, 4095, rows - 1])])
        if rows > 65535:
            positions = torch.cat([positions, torch.tensor([32767, 65535])])
        unit = torch.zeros(positions.shape[0], 1, rotary_dim)
        unit[..., :half] = 1.0
        rotated = before.rotary(unit, positions, theta, rotary_dim, True, False)
        table = kernels.build_cos_sin_table(kernels._inv_freq(theta, rotary_dim, torch.device("cpu")), rows)
        assert table.shape == (rows, 2, half) and table.dtype == torch.float32
        assert torch.equal(table[positions, 0], rotated[:, 0, :half]), (theta, rotary_dim, "cos")
        assert torch.equal(table[positions, 1], rotated[:, 0, half:]), (theta, rotary_dim, "sin")


@CASES.case
def table_grows_keeps_the_old_one_and_the_bits():
    from mok.kernels import rotary as kernels
    from tests.helpers import rotary_per_token as before

    x, positions = _inputs(3, 32, torch.float16, seed=1)
    want = before.rotary(x, positions, 1e4, 32, True, False)
    kernels.clear_tables()
    key = (1e4, 32, None, x.device)
    _assert_same_bits(kernels.rotary(x, positions, 1e4, 32, True, False), want, "first")
    small = kernels._TABLE_CACHE[key]
    _assert_same_bits(kernels.rotary(x, positions, 1e4, 32, True, False, max_positions=40000), want, "grown")
    grown = kernels._TABLE_CACHE[key]
    assert grown.shape[0] == 65536 and any(t is small for t in kernels._RETIRED)
    assert torch.equal(grown[:4096], small)  # the same entries, computed again
    # a smaller request keeps the larger table
    _assert_same_bits(kernels.rotary(x[:2], positions[:2], 1e4, 32, True, False), want[:2], "after growth")
    assert kernels._TABLE_CACHE[key] is grown


def yarn_gives_the_reference_bits(dtype, neox):
    """YaRN (DeepSeek-V3's rope): the kernel's host-blended inv_freq and its attention factor in the table and in
    the per-token branch give the same bits, and the CPU reference's (fp16, fp32: the interpreter truncates bf16
    casts), forward and backward; its table is its own (the plain rope's stays as it was)."""
    from mok.kernels import rotary as kernels
    from mok.reference import rotary as reference

    yarn = reference.YarnScaling(40.0, 64, 32.0, 1.0, 1.2345)
    x, positions = _inputs(3, 40, dtype, seed=2)
    kernels.clear_tables()
    for inverse in (False, True):
        per_token = kernels.rotary(x, positions, 1e4, 24, neox, inverse, use_table=False, yarn=yarn)
        _assert_same_bits(kernels.rotary(x, positions, 1e4, 24, neox, inverse, yarn=yarn), per_token,
                          f"yarn table inverse={inverse}")
        if dtype != torch.bfloat16:
            _assert_same_bits(per_token, reference.rotary(x, positions, 1e4, 24, neox, inverse, yarn),
                              f"yarn reference inverse={inverse}")
            _assert_same_bits(kernels.rotary(x, positions, 1e4, 24, neox, inverse),
                              reference.rotary(x, positions, 1e4, 24, neox, inverse), f"plain inverse={inverse}")
    assert (1e4, 24, yarn, x.device) in kernels._TABLE_CACHE
    assert ((1e4, 24, None, x.device) in kernels._TABLE_CACHE) == (dtype != torch.bfloat16)


CASES.parametrize(yarn_gives_the_reference_bits, dtype=DTYPES, neox=[True, False])


test_table_under_interpreter = interpreter_test(CASES, __file__)


def test_table_rows_from_sizes_only():
    pytest.importorskip("triton")
    from mok.kernels.rotary import table_rows_wanted

    assert table_rows_wanted(1, 128) == 4096  # decode: the minimum
    assert table_rows_wanted(5000, 128) == 8192  # packed batch: positions below T
    assert table_rows_wanted(65536, 128) == 65536
    assert table_rows_wanted(1 << 20, 128) == 131072  # the token count alone grows it to 64 MiB at most
    assert table_rows_wanted(1 << 20, 64) == 262144
    assert table_rows_wanted(1, 128, max_positions=40960) == 65536  # the caller's bound, as a power of two
    assert table_rows_wanted(1, 128, max_positions=1 << 19) == 1 << 19
    assert table_rows_wanted(1, 128, max_positions=1_024_000) == 1 << 19  # at most 256 MiB (R = 128)
    assert table_rows_wanted(1 << 20, 128, max_positions=1 << 20) == 1 << 19


def test_max_positions_is_validated_and_changes_nothing_on_cpu():
    import mok
    from mok.errors import UnsupportedError

    x, positions = torch.randn(4, 3, 16), torch.tensor([0, 5, 70000, 3])
    assert torch.equal(mok.rotary(x, positions, 1e4, max_positions=8), mok.rotary(x, positions, 1e4))
    with pytest.raises(UnsupportedError, match="max_positions"):
        mok.rotary(x, positions, 1e4, max_positions=-1)
    with pytest.raises(UnsupportedError, match="max_positions"):
        mok.rotary(x, positions, 1e4, max_positions=2.5)


if __name__ == "__main__":
    sys.exit(run_cases(CASES))
