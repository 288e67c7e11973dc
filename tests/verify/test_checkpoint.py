"""mok-verify checkpoint / hash: every checkpoint layout, bitwise comparison with counts and max abs
diff, missing/extra/mismatched tensors, slab streaming, manifests on either side, progress on stderr."""
import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

import verify
from verify import checkpoint_sources as ckpt
from verify.cli import main


def state_dict(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(37, 5, generator=g).bfloat16(),
        "layers.0.w13": torch.randn(3, 10, 5, generator=g).bfloat16(),
        "layers.0.norm": torch.randn(5, generator=g),
        "layers.0.bias64": torch.randn(4, 3, generator=g).double(),
        "layers.0.scale": torch.tensor(0.5),
        "layers.0.mask": torch.randn(2, 7, generator=g) > 0,
        "counts": torch.arange(9, dtype=torch.int32).reshape(3, 3),
        "empty": torch.zeros(0, 4),
    }


def write(layout, sd, root):
    root.mkdir(parents=True, exist_ok=True)
    if layout == "safetensors":
        save_file(sd, root / "model.safetensors")
        return root / "model.safetensors"
    if layout == "sharded":
        names = list(sd)
        shards = {"model-00001-of-00002.safetensors": names[:4], "model-00002-of-00002.safetensors": names[4:]}
        for file, keys in shards.items():
            save_file({k: sd[k] for k in keys}, root / file)
        index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
        (root / "model.safetensors.index.json").write_text(json.dumps(index))
        return root
    if layout in ("pt", "bin"):
        torch.save(sd, root / f"model.{layout}")
        return root / f"model.{layout}"
    if layout == "nested-pt":
        torch.save({"model": sd, "step": 3}, root / "ckpt.pt")
        return root / "ckpt.pt"
    if layout == "dir-of-safetensors":
        names = list(sd)
        save_file({k: sd[k] for k in names[:3]}, root / "a.safetensors")
        save_file({k: sd[k] for k in names[3:]}, root / "b.safetensors")
        return root
    raise ValueError(layout)


LAYOUTS = ["safetensors", "sharded", "pt", "bin", "dir-of-safetensors"]


@pytest.mark.parametrize("layout_b", LAYOUTS)
@pytest.mark.parametrize("layout_a", ["safetensors", "pt"])
def test_same_weights_in_any_layout_are_identical(tmp_path, layout_a, layout_b):
    a = write(layout_a, state_dict(), tmp_path / "a")
    b = write(layout_b, state_dict(), tmp_path / "b")
    result = verify.compare_checkpoints(a, b)
    assert result.identical and result.n_identical == len(state_dict())


def test_differences_are_counted_and_measured(tmp_path):
    sd_a, sd_b = state_dict(), state_dict()
    sd_b["layers.0.w13"][1, 2, [0, 3]] += torch.tensor([0.5, -2.0]).bfloat16()
    sd_b["layers.0.norm"][4] = -sd_b["layers.0.norm"][4]
    sd_b["layers.0.mask"][1, 6] = ~sd_b["layers.0.mask"][1, 6]
    sd_b["counts"] = sd_b["counts"].to(torch.int64)
    sd_b["embed.weight"] = sd_b["embed.weight"][:36]
    del sd_b["layers.0.scale"]
    sd_b["new.tensor"] = torch.ones(2)
    a = write("safetensors", sd_a, tmp_path / "a")
    b = write("sharded", sd_b, tmp_path / "b")
    result = verify.compare_checkpoints(a, b)
    diffs = {d.name: d for d in result.differing}
    assert set(diffs) == {"layers.0.w13", "layers.0.norm", "layers.0.mask"}
    for name in ["layers.0.w13", "layers.0.norm"]:
        ta, tb = sd_a[name], sd_b[name]
        differ = ta.view(torch.int16 if ta.itemsize == 2 else torch.int32) != tb.view(
            torch.int16 if tb.itemsize == 2 else torch.int32)
        assert diffs[name].n_differ == int(differ.sum())
        assert diffs[name].max_abs_diff == float((ta.double() - tb.double()).abs().max())
        assert diffs[name].n_elements == ta.numel()
    assert diffs["layers.0.w13"].n_differ == 2 and diffs["layers.0.mask"].n_differ == 1
    assert result.missing == ["layers.0.scale"] and result.extra == ["new.tensor"]
    assert sorted(m["name"] for m in result.mismatched) == ["counts", "embed.weight"]
    assert result.n_identical == 2 and not result.identical
    run = CliRunner().invoke(main, ["checkpoint", str(a), str(b), "--json"])
    doc = json.loads(run.stdout)
    assert run.exit_code == 1 and doc["missing"] == ["layers.0.scale"] and len(doc["differing"]) == 3


def test_signed_zero_and_nan_payload_count_as_differences(tmp_path):
    a = {"x": torch.zeros(3, 2)}
    b = {"x": torch.zeros(3, 2)}
    b["x"][0, 1] = -0.0
    b["x"][2, 0] = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)[0]
    a["x"][2, 0] = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)[0]
    result = verify.compare_checkpoints(write("safetensors", a, tmp_path / "a"),
                                        write("safetensors", b, tmp_path / "b"))
    (d,) = result.differing
    assert (d.n_differ, d.n_nan, d.max_abs_diff) == (2, 1, 0.0)


def test_streams_in_slabs(tmp_path, monkeypatch):
    sd_a, sd_b = state_dict(), state_dict()
    sd_b["embed.weight"][[2, 30], 1] += 1
    a = write("safetensors", sd_a, tmp_path / "a")
    b = write("pt", sd_b, tmp_path / "b")
    whole = verify.compare_checkpoints(a, b)
    reads = []
    source_read = ckpt.SafetensorsFile.read

    def spy(self, name, start=None, stop=None):
        reads.append((name, start, stop))
        return source_read(self, name, start, stop)

    monkeypatch.setattr(ckpt, "SLAB_BYTES", 25)  # 2 rows of embed (5 bf16 = 10 bytes each) per slab
    monkeypatch.setattr(ckpt.SafetensorsFile, "read", spy)
    sliced = verify.compare_checkpoints(a, b)
    assert sliced.to_json() == whole.to_json() and sliced.differing[0].n_differ == 2
    embed_reads = [r for r in reads if r[0] == "embed.weight"]
    assert len(embed_reads) == 19 and all(stop - start <= 2 for _, start, stop in embed_reads)
    # Slab-wise digests equal the whole-tensor fingerprint.
    manifest = verify.hash_checkpoint(a)
    assert manifest["tensors"]["embed.weight"]["digest"] == verify.fingerprint(sd_a["embed.weight"])


def test_manifest_on_either_side(tmp_path):
    sd = state_dict()
    a = write("sharded", sd, tmp_path / "a")
    run = CliRunner().invoke(main, ["hash", str(a), "-o", str(tmp_path / "a.json")])
    assert run.exit_code == 0
    manifest = json.loads((tmp_path / "a.json").read_text())
    assert manifest["tensors"]["layers.0.w13"] == {"dtype": "bfloat16", "shape": [3, 10, 5],
                                                   "digest": verify.fingerprint(sd["layers.0.w13"])}
    assert len(manifest["tensors"]) == len(sd)
    same = write("pt", sd, tmp_path / "same")
    assert verify.compare_checkpoints(tmp_path / "a.json", same).identical
    assert verify.compare_checkpoints(same, tmp_path / "a.json").identical
    assert verify.compare_checkpoints(tmp_path / "a.json", tmp_path / "a.json").identical
    sd["counts"][1, 1] = 100
    changed = write("bin", sd, tmp_path / "changed")
    result = verify.compare_checkpoints(tmp_path / "a.json", changed)
    (d,) = result.differing
    assert d.name == "counts" and d.n_differ is None
    run = CliRunner().invoke(main, ["checkpoint", str(changed), str(tmp_path / "a.json")])
    assert run.exit_code == 1 and "counts" in run.stdout
    stdout_manifest = CliRunner().invoke(main, ["hash", str(same)])
    assert json.loads(stdout_manifest.stdout)["tensors"] == manifest["tensors"]


def test_nested_torch_state_dicts_are_flattened(tmp_path):
    path = write("nested-pt", state_dict(), tmp_path / "n")
    names = ckpt.open_source(path).names()
    assert names == [f"model.{k}" for k in state_dict()]


def test_progress_bar_goes_to_stderr_only_when_asked(tmp_path):
    a = write("safetensors", state_dict(), tmp_path / "a")
    quiet = CliRunner().invoke(main, ["checkpoint", str(a), str(a)])
    loud = CliRunner().invoke(main, ["checkpoint", str(a), str(a), "--progress"])
    assert quiet.exit_code == loud.exit_code == 0
    assert quiet.stderr == "" and "comparing" in loud.stderr
    assert quiet.stdout == loud.stdout == f"identical: {len(state_dict())} tensors\n"
