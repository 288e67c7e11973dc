"""Large tensors are hashed in slices whatever their shape (a 1-D tensor is one long row), with bounded
temporary memory, and the digests stay bit-for-bit those of the unsliced definition."""
import tracemalloc

import pytest
import torch
from safetensors.torch import save_file

import verify
import verify.checkpoint_sources as checkpoint_sources
import verify.fingerprints as fingerprints
from tests.helpers import reference


def tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "bf16_1d": torch.randn(100_003, generator=g).bfloat16(),
        "bool_1d": torch.rand(70_001, generator=g) > 0.5,
        "f64_2d": torch.randn(3, 20_001, generator=g).double(),
        "i16_view": (torch.arange(200_006, dtype=torch.int16) * 7)[::2],
        "u8_3d": torch.randint(0, 255, (2, 3, 40_005), generator=g, dtype=torch.uint8),
    }


# Digests of tensors() computed with verify as it was before slicing (git HEAD at the change): frozen here.
FROZEN = {
    "bf16_1d": "550d28aff5f818b00697e5e932452fbb",
    "bool_1d": "743e179ef460e26eb8848bdffb65ca8a",
    "f64_2d": "0b7bfc2f7c7b7a8b01d1fd3114d39103",
    "i16_view": "c03aca3aa065711a65bf93b31f1753ef",
    "u8_3d": "9f2db03e7ca25facaa9613c18378eab6",
}


@pytest.mark.parametrize("block_words", [fingerprints._CPU_BLOCK_WORDS, 4096, 1000, 7, 3])
def test_sliced_digests_equal_the_unsliced_ones(monkeypatch, block_words):
    monkeypatch.setattr(fingerprints, "_CPU_BLOCK_WORDS", block_words)
    for name, t in tensors().items():
        assert verify.fingerprint(t) == FROZEN[name], name
    small = tensors()["bf16_1d"][:5003]
    assert verify.row_fingerprints(small).tolist() == reference.row_digests(small)


def test_one_dimensional_tensor_uses_bounded_numpy_memory(monkeypatch):
    x = torch.randint(-2**31, 2**31 - 1, (1 << 21,), dtype=torch.int32)  # 8 MiB, one row
    want = verify.fingerprint(x)
    monkeypatch.setattr(fingerprints, "_CPU_BLOCK_WORDS", 1 << 12)  # 32 KiB of words per slice
    tracemalloc.start()
    try:
        got = verify.fingerprint(x)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == want
    assert peak < 1 << 20, peak  # unsliced: keys + mixed words, 2 x 8 MiB


@pytest.mark.parametrize("slab_bytes", [checkpoint_sources.SLAB_BYTES, 4096, 1000, 200])
def test_checkpoint_hash_of_one_dimensional_tensors_reads_slices(tmp_path, monkeypatch, slab_bytes):
    ts = tensors()
    path = tmp_path / "m.safetensors"
    save_file({name: t.contiguous() for name, t in ts.items()}, path)
    monkeypatch.setattr(checkpoint_sources, "SLAB_BYTES", slab_bytes)
    monkeypatch.setattr(fingerprints, "_CPU_BLOCK_WORDS", 1000)
    reads = []
    read = checkpoint_sources.SafetensorsFile.read

    def spy(self, name, start=None, stop=None):
        out = read(self, name, start, stop)
        reads.append((name, out.numel() * out.element_size()))
        return out

    monkeypatch.setattr(checkpoint_sources.SafetensorsFile, "read", spy)
    manifest = verify.hash_checkpoint(path, progress=False)
    assert {name: entry["digest"] for name, entry in manifest["tensors"].items()} == FROZEN
    if slab_bytes < checkpoint_sources.SLAB_BYTES:
        one_d = [size for name, size in reads if name in ("bf16_1d", "bool_1d")]
        assert len(one_d) > 2 and max(one_d) <= max(slab_bytes, 8 * 8)
    # The comparison walks the same slices and still finds a single changed element.
    other = dict(ts)
    changed = ts["bf16_1d"].clone()
    changed[-1] = 7.0
    other["bf16_1d"] = changed
    save_file({name: t.contiguous() for name, t in other.items()}, tmp_path / "o.safetensors")
    result = verify.compare_checkpoints(path, tmp_path / "o.safetensors")
    assert [(d.name, d.n_differ) for d in result.differing] == [("bf16_1d", 1)] and result.n_identical == 4


def test_checkpoint_hash_of_a_one_dimensional_tensor_uses_bounded_numpy_memory(tmp_path, monkeypatch):
    x = torch.randint(-2**31, 2**31 - 1, (1 << 21,), dtype=torch.int32)  # 8 MiB: one slab, one row
    path = tmp_path / "x.safetensors"
    save_file({"x": x}, path)
    want = verify.fingerprint(x)
    monkeypatch.setattr(fingerprints, "_CPU_BLOCK_WORDS", 1 << 12)
    tracemalloc.start()
    try:
        got = verify.hash_checkpoint(path, progress=False)["tensors"]["x"]["digest"]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == want and peak < 1 << 20, peak
