"""Execution contracts (metadata `execution_contract`, compared before any tensor), and malformed
traces and manifests: typed `VerifyError`s from the API, exit code 2 from the command line."""
import json
import sqlite3

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

import verify
from verify.checkpoint import compare_checkpoints, hash_checkpoint
from verify.cli import main
from verify.compare import ABSENT
from verify.errors import ManifestError, TraceError, VerifyError
from verify.store import Trace

CONTRACT = {"torch": "2.11.0", "mok": "0.3.0", "device": "cpu", "config_digest": "abc123", "tp": 1}


def write(path, contract=None, scale=1.0, **meta):
    if contract is not None:
        meta["execution_contract"] = contract
    with verify.Recorder(path, run="r", meta=meta, overwrite=True) as rec:
        rec.record("layer", torch.arange(6.0).reshape(2, 3) * scale)
        rec.step()
    return path


def run_cli(*args):
    run = CliRunner().invoke(main, [str(a) for a in args])
    return run.exit_code, run.stdout, run.stderr


def test_meta_holds_the_contract_and_trace_reads_it(tmp_path):
    path = write(tmp_path / "a.db", CONTRACT, seed=3)
    with Trace(path) as trace:
        assert trace.meta == {"execution_contract": CONTRACT, "seed": 3}
        assert trace.contract == CONTRACT
    assert verify.CONTRACT_KEY == "execution_contract"
    with Trace(write(tmp_path / "none.db")) as trace:
        assert trace.contract is None


def test_recorder_refuses_a_contract_that_is_not_an_object(tmp_path):
    with pytest.raises(verify.RecorderError, match="execution_contract"):
        verify.Recorder(tmp_path / "x.db", meta={"execution_contract": ["torch", "2.11"]})
    assert not (tmp_path / "x.db").exists()


def test_equal_contracts_are_silent(tmp_path):
    a, b = write(tmp_path / "a.db", CONTRACT), write(tmp_path / "b.db", dict(CONTRACT))
    result = verify.diff_traces(a, b)
    assert result.identical and result.contract_mismatch == {} and result.contract_note is None
    code, out, _ = run_cli("diff", a, b)
    assert code == 0 and out.startswith("identical: 1 records")


def test_contract_mismatch_is_reported_first(tmp_path):
    other = {**CONTRACT, "torch": "2.12.0", "tp": 1.0, "extra": True}
    del other["device"]
    a, b = write(tmp_path / "a.db", CONTRACT), write(tmp_path / "b.db", other, scale=2.0)
    result = verify.diff_traces(a, b)
    assert not result.identical and result.divergence is not None
    assert result.contract_mismatch == {"device": ("cpu", ABSENT), "extra": (ABSENT, True),
                                        "torch": ("2.11.0", "2.12.0"), "tp": (1, 1.0)}
    doc = result.to_json()
    assert doc["contract_mismatch"] == {"device": {"a": "cpu"}, "extra": {"b": True},
                                        "torch": {"a": "2.11.0", "b": "2.12.0"}, "tp": {"a": 1, "b": 1.0}}
    code, out, _ = run_cli("diff", a, b)
    lines = out.splitlines()
    assert code == 1
    assert lines[0].startswith("execution contract differs (4 keys)")
    assert lines[1:5] == ['  device: A "cpu"   B (absent)', "  extra: A (absent)   B true",
                          '  torch: A "2.11.0"   B "2.12.0"', "  tp: A 1   B 1.0"]
    assert lines[5].startswith("first divergence at record 0")
    code, out, _ = run_cli("diff", a, b, "--json")
    assert code == 1 and json.loads(out)["contract_mismatch"]["torch"] == {"a": "2.11.0", "b": "2.12.0"}
    code, out, _ = run_cli("diff", a, b, "--align", "content")
    assert code == 1 and out.startswith("execution contract differs (4 keys)")


def test_contract_mismatch_alone_means_diverged(tmp_path):
    a = write(tmp_path / "a.db", CONTRACT)
    b = write(tmp_path / "b.db", {**CONTRACT, "device": "cuda:0"})
    result = verify.diff_traces(a, b)
    assert result.divergence is None and not result.identical
    assert result.contract_mismatch == {"device": ("cpu", "cuda:0")}
    code, out, _ = run_cli("diff", a, b)
    assert code == 1 and out.splitlines()[-1] == "records identical: 1 records (but the contracts differ)"


@pytest.mark.parametrize("side", ["a", "b"])
def test_one_sided_contract_is_a_note_not_a_mismatch(tmp_path, side):
    with_c, without = write(tmp_path / "c.db", CONTRACT), write(tmp_path / "n.db")
    a, b = (with_c, without) if side == "a" else (without, with_c)
    result = verify.diff_traces(a, b)
    assert result.identical and result.contract_mismatch == {}
    has, lacks = ("A", "B") if side == "a" else ("B", "A")
    assert result.contract_note == f"execution contract: only trace {has} has one (trace {lacks} records none): " \
                                   "not compared"
    code, out, _ = run_cli("diff", a, b)
    assert code == 0 and out.splitlines()[0] == result.contract_note


def corrupt(path, sql, *args):
    db = sqlite3.connect(path)
    db.execute(sql, args)
    db.commit()
    db.close()
    return path


MALFORMED = [
    ("meta-not-json", "UPDATE run SET value = '{not json' WHERE key = 'meta'", "metadata is not JSON"),
    ("meta-not-object", "UPDATE run SET value = '[1, 2]' WHERE key = 'meta'", "not a JSON object"),
    ("contract-not-object", "UPDATE run SET value = '{\"execution_contract\": 5}' WHERE key = 'meta'",
     "'execution_contract' is not a JSON object"),
    ("shape-garbage", "UPDATE records SET shape = 'garbage'", "has shape 'garbage'"),
    ("shape-negative", "UPDATE records SET shape = '[-1, 3]'", "not a JSON list of sizes"),
    ("shape-not-list", "UPDATE records SET shape = '{\"a\": 1}'", "not a JSON list of sizes"),
    ("rows-odd-length", "UPDATE records SET rows = x'0102030405'", "whole number of 64-bit words"),
    ("rows-text", "UPDATE records SET rows = 'abcdefgh'", "whole number of 64-bit words"),
    ("digest-not-text", "UPDATE records SET digest = x'00'", "wrong type"),
    ("step-not-int", "UPDATE steps SET n_records = 'x'", "non-integer"),
]


@pytest.mark.parametrize("sql, message", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_trace_is_a_trace_error(tmp_path, sql, message):
    good = write(tmp_path / "good.db", CONTRACT)
    bad = corrupt(write(tmp_path / "bad.db", CONTRACT), sql)

    def read_all():
        with Trace(bad) as trace:
            trace.steps()
            list(trace.records())
            verify.diff_traces(good, trace)

    with pytest.raises(TraceError, match=message):
        read_all()
    for args in (["diff", good, bad], ["diff", bad, good, "--align", "content"], ["report", bad, "--out",
                                                                                  tmp_path / "r"]):
        code, out, err = run_cli(*args)
        assert code == 2, (args, out, err)
        assert err.startswith("mok-verify: error: ") and len(err.splitlines()) == 1 and message in err, err


def manifest(tmp_path):
    st = tmp_path / "m.safetensors"
    save_file({"w": torch.randn(4, 3), "b": torch.zeros(3)}, st)
    doc = hash_checkpoint(st)
    return st, doc


BAD_ENTRIES = [
    ("dtype-nonsense", {"dtype": "float33"}, "has dtype 'float33'"),
    ("dtype-not-str", {"dtype": 7}, "has dtype 7"),
    ("shape-nonsense", {"shape": ["a", 3]}, "not a list of sizes"),
    ("shape-negative", {"shape": [-4, 3]}, "not a list of sizes"),
    ("shape-not-list", {"shape": "4x3"}, "not a list of sizes"),
    ("digest-short", {"digest": "abc"}, "not 32 hex digits"),
    ("digest-not-str", {"digest": None}, "not 32 hex digits"),
]


@pytest.mark.parametrize("change, message", [b[1:] for b in BAD_ENTRIES], ids=[b[0] for b in BAD_ENTRIES])
def test_malformed_manifest_is_an_error_not_a_mismatch(tmp_path, change, message):
    st, doc = manifest(tmp_path)
    doc["tensors"]["w"].update(change)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match=message):
        compare_checkpoints(st, path)
    for args in (["checkpoint", st, path], ["checkpoint", path, st]):
        code, out, err = run_cli(*args)
        assert code == 2 and out == "" and message in err and len(err.splitlines()) == 1, err


def test_valid_manifest_still_compares(tmp_path):
    st, doc = manifest(tmp_path)
    path = tmp_path / "good.json"
    path.write_text(json.dumps(doc))
    assert compare_checkpoints(st, path).identical
    doc["tensors"]["w"]["digest"] = "0" * 32
    path.write_text(json.dumps(doc))
    assert run_cli("checkpoint", st, path)[0] == 1  # a well-formed but different digest is a divergence


def test_everything_raised_is_a_verify_error():
    assert issubclass(TraceError, VerifyError) and issubclass(ManifestError, VerifyError)
