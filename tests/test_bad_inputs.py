"""The sweep: a table of bad arguments for every public entry point of verify, mok-verify, rl and mok, each
expecting the documented typed error (verify.VerifyError's subclasses, rl.InputError /
rl.UnsupportedModelError, mok.UnsupportedError) or, from the command line, exit code 2 with one
`mok-verify: error:` line (or click's usage error), never a raw exception or the catch-all
"unexpected ..." line."""
from __future__ import annotations

import importlib
import json
import math
import os
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

import mok
import rl
import verify
from verify.cli import main
from verify.errors import (
    ArgumentError,
    BisectError,
    CheckpointError,
    RecorderError,
    TraceError,
    UnsupportedDtypeError,
)
from verify.report import build_report, log_metrics, read_metrics, step_digests


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Good and bad inputs, made once: a trace, a checkpoint, a FIFO, a folder, malformed weight maps."""
    root = tmp_path_factory.mktemp("inputs")
    with verify.Recorder(root / "good.db") as rec:
        rec.record("x", torch.ones(3))
        rec.step()
    save_file({"w": torch.ones(2)}, root / "good.safetensors")
    (root / "folder").mkdir()
    (root / "empty_folder").mkdir()
    os.mkfifo(root / "fifo")
    (root / "not_a_trace.db").write_text("hello")
    (root / "not_a_trace.json").write_text('{"format": "x"}')
    for name, target in (("int", 3), ("null", None), ("parent", "../good.safetensors"),
                         ("absolute", str(root / "good.safetensors")), ("folder", "folder"), ("fifo", "fifo"),
                         ("empty", "")):
        (root / f"index_{name}.json").write_text(json.dumps({"weight_map": {"w": target}}))
    return root


# -- verify: the API -----------------------------------------------------------------------------------

def _recorder_call(root, action):
    rec = verify.Recorder(root / "scratch.db", overwrite=True)
    try:
        action(rec)
    finally:
        rec.close()


SPARSE = torch.eye(3).to_sparse()
VERIFY_API = [
    ("fingerprint of a list", lambda r: verify.fingerprint([1.0]), ArgumentError),
    ("fingerprint of None", lambda r: verify.fingerprint(None), ArgumentError),
    ("fingerprint of a sparse tensor", lambda r: verify.fingerprint(SPARSE), UnsupportedDtypeError),
    ("fingerprint of a CSR tensor", lambda r: verify.fingerprint(torch.eye(3).to_sparse_csr()), UnsupportedDtypeError),
    ("fingerprint of a meta tensor", lambda r: verify.fingerprint(torch.empty(2, device="meta")),
     UnsupportedDtypeError),
    ("fingerprint of complex", lambda r: verify.fingerprint(torch.ones(2, dtype=torch.complex64)),
     UnsupportedDtypeError),
    ("row_fingerprints of a sparse tensor", lambda r: verify.row_fingerprints(SPARSE), UnsupportedDtypeError),
    ("row_fingerprints of a str", lambda r: verify.row_fingerprints("x"), ArgumentError),
    ("Recorder(None)", lambda r: verify.Recorder(None), RecorderError),
    ("Recorder(3)", lambda r: verify.Recorder(3), RecorderError),
    ("Recorder(bytes)", lambda r: verify.Recorder(b"t.db"), RecorderError),
    ("Recorder('')", lambda r: verify.Recorder(""), RecorderError),
    ("Recorder on a folder", lambda r: verify.Recorder(r / "folder", overwrite=True), RecorderError),
    ("Recorder on a FIFO", lambda r: verify.Recorder(r / "fifo", overwrite=True), RecorderError),
    ("Recorder on /dev/null", lambda r: verify.Recorder("/dev/null", overwrite=True), RecorderError),
    ("Recorder inside a file", lambda r: verify.Recorder(r / "good.db" / "t.db"), RecorderError),
    ("Recorder run=None", lambda r: verify.Recorder(r / "n.db", run=None, overwrite=True), RecorderError),
    ("Recorder run=3", lambda r: verify.Recorder(r / "n.db", run=3, overwrite=True), RecorderError),
    ("Recorder rows='no'", lambda r: verify.Recorder(r / "n.db", rows="no", overwrite=True), RecorderError),
    ("Recorder overwrite='yes'", lambda r: verify.Recorder(r / "n.db", overwrite="yes"), RecorderError),
    ("Recorder meta list", lambda r: verify.Recorder(r / "n.db", meta=[1], overwrite=True), RecorderError),
    ("record name 3", lambda r: _recorder_call(r, lambda rec: rec.record(3, torch.ones(2))), RecorderError),
    ("record name None", lambda r: _recorder_call(r, lambda rec: rec.record(None, torch.ones(2))), RecorderError),
    ("record a list", lambda r: _recorder_call(r, lambda rec: rec.record("a", [1.0])), RecorderError),
    ("record sparse", lambda r: _recorder_call(r, lambda rec: rec.record("a", SPARSE)), UnsupportedDtypeError),
    ("record kind None", lambda r: _recorder_call(r, lambda rec: rec.record("a", torch.ones(1), kind=None)),
     RecorderError),
    ("record phase 3", lambda r: _recorder_call(r, lambda rec: rec.record("a", torch.ones(1), phase=3)),
     RecorderError),
    ("record rows 'x'", lambda r: _recorder_call(r, lambda rec: rec.record("a", torch.ones(1), rows="x")),
     RecorderError),
    ("attach a str", lambda r: _recorder_call(r, lambda rec: rec.attach("model")), RecorderError),
    ("attach a bad regex", lambda r: _recorder_call(
        r, lambda rec: rec.attach(torch.nn.Sequential(torch.nn.Linear(2, 2)), include="re:(")), RecorderError),
    ("attach include=3", lambda r: _recorder_call(
        r, lambda rec: rec.attach(torch.nn.Sequential(torch.nn.Linear(2, 2)), include=3)), RecorderError),
    ("attach types='Linear'", lambda r: _recorder_call(
        r, lambda rec: rec.attach(torch.nn.Sequential(torch.nn.Linear(2, 2)), types="Linear")), RecorderError),
    ("Trace(None)", lambda r: verify.Trace(None), ArgumentError),
    ("Trace of a folder", lambda r: verify.Trace(r / "folder"), TraceError),
    ("Trace of a FIFO", lambda r: verify.Trace(r / "fifo"), TraceError),
    ("Trace of a text file", lambda r: verify.Trace(r / "not_a_trace.db"), TraceError),
    ("records(step='x')", lambda r: list(verify.Trace(r / "good.db").records(step="x")), ArgumentError),
    ("records(name=3)", lambda r: list(verify.Trace(r / "good.db").records(name=3)), ArgumentError),
    ("diff_traces(None, ...)", lambda r: verify.diff_traces(None, r / "good.db"), ArgumentError),
    ("diff_traces(..., 3)", lambda r: verify.diff_traces(r / "good.db", 3), ArgumentError),
    ("diff_traces of a FIFO", lambda r: verify.diff_traces(r / "fifo", r / "good.db"), TraceError),
    ("align names=[1]", lambda r: verify.align_by_content(r / "good.db", r / "good.db", names=[1]), ArgumentError),
    ("compare_checkpoints(None, ...)", lambda r: verify.compare_checkpoints(None, r / "good.safetensors"),
     ArgumentError),
    ("compare_checkpoints of a FIFO", lambda r: verify.compare_checkpoints(r / "fifo", r / "fifo"), CheckpointError),
    ("compare_checkpoints of /dev/null", lambda r: verify.compare_checkpoints("/dev/null", "/dev/null"),
     CheckpointError),
    ("compare_checkpoints of an empty folder", lambda r: verify.compare_checkpoints(r / "empty_folder",
                                                                                    r / "empty_folder"),
     CheckpointError),
    ("compare_checkpoints progress='yes'", lambda r: verify.compare_checkpoints(
        r / "good.safetensors", r / "good.safetensors", progress="yes"), ArgumentError),
    *[(f"weight map {name}", lambda r, name=name: verify.compare_checkpoints(r / f"index_{name}.json",
                                                                             r / "good.safetensors"),
       CheckpointError) for name in ("int", "null", "parent", "absolute", "folder", "fifo", "empty")],
    ("hash_checkpoint(None)", lambda r: verify.hash_checkpoint(None), ArgumentError),
    ("hash_checkpoint of a FIFO", lambda r: verify.hash_checkpoint(r / "fifo"), CheckpointError),
    ("hash_checkpoint of a trace", lambda r: verify.hash_checkpoint(r / "good.db"), CheckpointError),
    ("bisect repo None", lambda r: verify.bisect(None, "a", "b", "true"), BisectError),
    ("bisect good 1", lambda r: verify.bisect(r, 1, "b", "true"), BisectError),
    ("bisect cmd None", lambda r: verify.bisect(r, "a", "b", None), BisectError),
    ("bisect output 3", lambda r: verify.bisect(r, "a", "b", "true", output=3), BisectError),
    ("bisect log 3", lambda r: verify.bisect(r, "a", "b", "true", log=3), BisectError),
    *[(f"bisect timeout {t!r}", lambda r, t=t: verify.bisect(r, "a", "b", "true", timeout=t), BisectError)
      for t in (math.inf, math.nan, -1, 0, "1", True)],
    ("build_report(None)", lambda r: build_report(None), ArgumentError),
    ("build_report out_dir=3", lambda r: build_report(r / "good.db", 3), ArgumentError),
    ("build_report other=3", lambda r: build_report(r / "good.db", r / "rep", other=3), ArgumentError),
    ("build_report names=[1]", lambda r: build_report(r / "good.db", r / "rep", names=[1]), ArgumentError),
    ("build_report order=[1]", lambda r: build_report(r / "good.db", r / "rep", order=[1]), ArgumentError),
    ("build_report out_dir a file", lambda r: build_report(r / "good.db", r / "good.safetensors"),
     verify.VerifyError),
    ("log_metrics step 'x'", lambda r: log_metrics(r / "good.db", "x", {"a": 1.0}), ArgumentError),
    ("log_metrics values list", lambda r: log_metrics(r / "good.db", 0, [1.0]), ArgumentError),
    ("log_metrics value 'x'", lambda r: log_metrics(r / "good.db", 0, {"a": "x"}), ArgumentError),
    ("log_metrics path None", lambda r: log_metrics(None, 0, {"a": 1.0}), ArgumentError),
    ("log_metrics to a JSON file", lambda r: log_metrics(r / "not_a_trace.json", 0, {"a": 1.0}), TraceError),
    ("read_metrics(None)", lambda r: read_metrics(None), ArgumentError),
    ("step_digests steps='ab'", lambda r: step_digests(r / "good.db", steps="ab"), ArgumentError),
    ("step_digests(None)", lambda r: step_digests(None), ArgumentError),
]


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize(("call", "error"), [(c, e) for _, c, e in VERIFY_API], ids=[n for n, _, _ in VERIFY_API])
def test_verify_api_raises_typed_errors(files, call, error):
    before = {p: p.read_bytes() for p in files.iterdir()
              if p.is_file() and p.name.startswith(("good.", "not_a_trace.", "index_"))}
    with pytest.raises(error):
        call(files)
    after = {p: p.read_bytes() for p in before}
    assert after == before  # a refused call changes no input


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_bisect_on_a_real_repository_bytes_and_timeouts(tmp_path):
    from tests.helpers.git_repo import commit_each, new_repo

    repo = tmp_path / "repo"
    git = new_repo(repo)
    save_file({"w": torch.ones(2)}, repo / "w.safetensors")
    revs = commit_each(git, repo, "n", 3)
    noisy = "printf '\\377\\376 bytes\\n'; printf '\\377\\n' >&2; cp w.safetensors {output}"
    result = verify.bisect(repo, revs[0], revs[-1], noisy, log=lambda _: None)
    assert result.first_bad is None
    failing = "printf 'bad \\377\\n' >&2; exit 3"
    with pytest.raises(BisectError, match="exit code 3"):
        verify.bisect(repo, revs[0], revs[-1], failing, log=lambda _: None)
    run = CliRunner().invoke(main, ["bisect", "--repo", str(repo), "--good", revs[0], "--bad", revs[-1],
                                    "--cmd", failing])
    assert run.exit_code == 2 and "unexpected" not in run.stderr
    for timeout in (math.inf, math.nan, -1.0):  # refused before anything runs, on a repository that works
        with pytest.raises(BisectError, match="timeout"):
            verify.bisect(repo, revs[0], revs[-1], noisy, log=lambda _: None, timeout=timeout)
        run = CliRunner().invoke(main, ["bisect", "--repo", str(repo), "--good", revs[0], "--bad", revs[-1],
                                        "--cmd", noisy, "--timeout", str(timeout)])
        assert run.exit_code == 2 and "timeout" in run.stderr and "unexpected" not in run.stderr, run.stderr


# -- mok-verify: the command line ------------------------------------------------------------------------

CLI = [
    ("diff missing", ["diff", "{r}/missing.db", "{r}/good.db"]),
    ("diff folder", ["diff", "{r}/folder", "{r}/good.db"]),
    ("diff FIFO", ["diff", "{r}/fifo", "{r}/good.db"]),
    ("diff not a trace", ["diff", "{r}/good.db", "{r}/not_a_trace.db"]),
    ("diff bad --align", ["diff", "{r}/good.db", "{r}/good.db", "--align", "bogus"]),
    ("checkpoint FIFO", ["checkpoint", "{r}/fifo", "{r}/good.safetensors"]),
    ("checkpoint /dev/null", ["checkpoint", "/dev/null", "{r}/good.safetensors"]),
    ("checkpoint empty folder", ["checkpoint", "{r}/empty_folder", "{r}/good.safetensors"]),
    ("checkpoint a trace", ["checkpoint", "{r}/good.db", "{r}/good.safetensors"]),
    *[(f"checkpoint weight map {name}", ["checkpoint", f"{{r}}/index_{name}.json", "{r}/good.safetensors"])
      for name in ("int", "null", "parent", "absolute", "folder", "fifo", "empty")],
    ("hash FIFO", ["hash", "{r}/fifo"]),
    ("hash -o a folder", ["hash", "{r}/good.safetensors", "-o", "{r}/folder"]),
    ("hash -o over its input", ["hash", "{r}/good.safetensors", "-o", "{r}/good.safetensors"]),
    ("hash -o in a missing folder", ["hash", "{r}/good.safetensors", "-o", "{r}/missing/m.json"]),
    *[(f"bisect --timeout {t}", ["bisect", "--repo", "{r}", "--good", "a", "--bad", "b", "--cmd", "true",
                                 "--timeout", t]) for t in ("inf", "nan", "-1", "0", "abc")],
    ("bisect missing repo", ["bisect", "--repo", "{r}/missing", "--good", "a", "--bad", "b", "--cmd", "true"]),
    ("bisect repo a file", ["bisect", "--repo", "{r}/good.db", "--good", "a", "--bad", "b", "--cmd", "true"]),
    ("bisect not a repo", ["bisect", "--repo", "{r}/folder", "--good", "a", "--bad", "b", "--cmd", "true"]),
    ("report missing", ["report", "{r}/missing.db"]),
    ("report --out a file", ["report", "{r}/good.db", "--out", "{r}/good.safetensors"]),
    ("report --against missing", ["report", "{r}/good.db", "--out", "{r}/rep", "--against", "{r}/missing.db"]),
    ("report --against a FIFO", ["report", "{r}/good.db", "--out", "{r}/rep", "--against", "{r}/fifo"]),
    ("unknown command", ["frobnicate"]),
]


@pytest.mark.parametrize("args", [a for _, a in CLI], ids=[n for n, _ in CLI])
def test_cli_exits_2_with_one_line(files, args, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(files.parent))  # `folder` is no git repository
    run = CliRunner().invoke(main, [a.format(r=files) for a in args])
    assert run.exit_code == 2, (run.exit_code, run.output)
    assert "Traceback" not in run.output and "unexpected" not in run.stderr, run.stderr
    lines = run.stderr.strip().splitlines()
    assert lines[-1].startswith(("mok-verify: error: ", "Error: ")), run.stderr
    if lines[-1].startswith("mok-verify: error: "):
        assert len(lines) == 1, run.stderr


# -- rl ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    from rl.testing import tiny_model

    return rl.wrap(tiny_model("qwen3_moe", seed=0))


IDS = torch.randint(3, 512, (2, 5), generator=torch.Generator().manual_seed(0))
META_IDS = torch.empty(2, 5, dtype=torch.long, device="meta")
RL_API = [
    ("logprobs ids list", lambda m: rl.logprobs(m, [[1, 2]]), rl.InputError),
    ("logprobs ids float", lambda m: rl.logprobs(m, IDS.float()), rl.InputError),
    ("logprobs ids 3-D", lambda m: rl.logprobs(m, IDS[None]), rl.InputError),
    ("logprobs ids on meta", lambda m: rl.logprobs(m, META_IDS), rl.InputError),
    ("logprobs mask on meta", lambda m: rl.logprobs(m, IDS, META_IDS), rl.InputError),
    ("logprobs sparse ids", lambda m: rl.logprobs(m, IDS.to_sparse()), rl.InputError),
    ("logprobs mask shape", lambda m: rl.logprobs(m, IDS, torch.ones(2, 4, dtype=torch.long)), rl.InputError),
    ("logprobs id out of vocabulary", lambda m: rl.logprobs(m, IDS + 600), rl.InputError),
    ("logprobs of None", lambda m: rl.logprobs(None, IDS), rl.UnsupportedModelError),
    ("logprobs of a Linear", lambda m: rl.logprobs(torch.nn.Linear(2, 2), IDS), rl.UnsupportedModelError),
    ("generate temperature nan", lambda m: rl.generate(m, [[5]], 2, temperature=math.nan), rl.InputError),
    ("generate batch_size -1", lambda m: rl.generate(m, [[5]], 2, batch_size=-1), rl.InputError),
    ("generate max_new_tokens 1.5", lambda m: rl.generate(m, [[5]], 1.5), rl.InputError),
    ("generate top_k 1.5", lambda m: rl.generate(m, [[5]], 2, top_k=1.5), rl.InputError),
    ("generate seed 'a'", lambda m: rl.generate(m, [[5]], 2, seed="a"), rl.InputError),
    ("generate eos 1.5", lambda m: rl.generate(m, [[5]], 2, eos_token_id=1.5), rl.InputError),
    ("generate prompts None", lambda m: rl.generate(m, None, 2), rl.InputError),
    ("generate empty prompt", lambda m: rl.generate(m, [[]], 2), rl.InputError),
    ("generate of None", lambda m: rl.generate(None, [[5]], 2), rl.UnsupportedModelError),
    ("padded pad 'x'", lambda m: rl.Generation([[1]], [[2]], [torch.zeros(1)]).padded("x"), rl.InputError),
    ("padded left 'no'", lambda m: rl.Generation([[1]], [[2]], [torch.zeros(1)]).padded(left="no"), rl.InputError),
    ("contract of None", lambda m: rl.contract(None), rl.UnsupportedModelError),
    ("check_contract of lists", lambda m: rl.check_contract([1], [1]), rl.InputError),
    ("runtime_contract of a missing device", lambda m: importlib.import_module("rl.contract").runtime_contract(
        "cuda:99" if torch.cuda.is_available() else "cuda"), rl.InputError),
    ("wrap of None", lambda m: rl.wrap(None), rl.UnsupportedModelError),
    ("wrap of a Linear", lambda m: rl.wrap(torch.nn.Linear(2, 2)), rl.UnsupportedModelError),
    ("wrapped forward ids float", lambda m: m(IDS.float()), rl.InputError),
    ("wrapped forward id out of vocabulary", lambda m: m(IDS + 600), rl.InputError),
    ("wrapped forward ids on meta", lambda m: m(META_IDS), rl.InputError),
]


def _rl_id(entry):
    return entry.values[0] if hasattr(entry, "values") else entry[0]


@pytest.mark.parametrize(("name", "call", "error"), RL_API, ids=[_rl_id(e) for e in RL_API])
def test_rl_api_raises_typed_errors(model, name, call, error):
    with pytest.raises(error):
        call(model)


# -- mok ops ----------------------------------------------------------------------------------------------

T, H, I, E = 4, 8, 6, 4
_G = torch.Generator().manual_seed(0)
X, W, LIN = torch.randn(T, H, generator=_G), torch.ones(H), torch.randn(3, H, generator=_G)
LOGITS = torch.randn(T, E, generator=_G)
W13, W2 = torch.randn(E, 2 * I, H, generator=_G) * 0.1, torch.randn(E, H, I, generator=_G) * 0.1
Q, K = torch.randn(T, 4, 8, generator=_G), torch.randn(T, 2, 8, generator=_G)
CU = torch.tensor([0, T], dtype=torch.int32)
CACHE, TABLE = torch.zeros(3, 4, 2, 8), torch.tensor([[0, 1]], dtype=torch.int32)
LENS = torch.tensor([T], dtype=torch.int32)

MOK_API = [
    ("rms_norm eps nan", lambda: mok.rms_norm(X, W, math.nan)),
    ("rms_norm x list", lambda: mok.rms_norm([1.0], W, 1e-6)),
    ("rms_norm x int64", lambda: mok.rms_norm(X.long(), W, 1e-6)),
    ("rms_norm sparse x", lambda: mok.rms_norm(X.to_sparse(), W, 1e-6)),
    ("linear bias list", lambda: mok.linear(X, LIN, [1.0])),
    ("linear sparse weight", lambda: mok.linear(X, LIN.to_sparse())),
    ("silu_and_mul odd", lambda: mok.silu_and_mul(torch.randn(T, 3))),
    ("route top_k 0", lambda: mok.route(LOGITS, 0)),
    ("route top_k 2.0", lambda: mok.route(LOGITS, 2.0)),
    ("route on meta", lambda: mok.route(LOGITS.to("meta"), 2)),
    ("moe top_k '2'", lambda: mok.moe(X, LOGITS, W13, W2, "2")),
    ("moe renormalize 'no'", lambda: mok.moe(X, LOGITS, W13, W2, 2, renormalize="no")),
    ("moe name 3", lambda: mok.moe(X, LOGITS, W13, W2, 2, name=3)),
    ("moe ids out of range", lambda: mok.moe(X, LOGITS, W13, W2, 2, topk_ids=torch.full((T, 2), 9))),
    ("moe sparse w13", lambda: mok.moe(X, LOGITS, W13.to_sparse(), W2, 2)),
    ("moe sparse ids", lambda: mok.moe(X, LOGITS, W13, W2, 2,
                                       topk_ids=torch.zeros(T, 2, dtype=torch.long).to_sparse())),
    ("moe double backward", lambda: _moe_double_backward()),
    ("attention scale None", lambda: mok.attention(Q, K, K, CU, CU, None)),
    ("attention scale nan", lambda: mok.attention(Q, K, K, CU, CU, math.nan)),
    ("attention scale '0.3'", lambda: mok.attention(Q, K, K, CU, CU, "0.3")),
    ("attention causal 'no'", lambda: mok.attention(Q, K, K, CU, CU, 0.3, causal="no")),
    ("attention cu list", lambda: mok.attention(Q, K, K, [0, 4], [0, 4], 0.3)),
    ("attention sparse q", lambda: mok.attention(Q.to_sparse(), K, K, CU, CU, 0.3)),
    ("paged_attention scale 'x'", lambda: mok.paged_attention(Q, CACHE, CACHE, CU, LENS, TABLE, "x")),
    ("paged_attention decode 1", lambda: mok.paged_attention(Q, CACHE, CACHE, CU, LENS, TABLE, 0.3, decode=1)),
    ("paged_attention q None", lambda: mok.paged_attention(None, CACHE, CACHE, CU, LENS, TABLE, 0.3)),
    ("paged_attention page out of range", lambda: mok.paged_attention(
        Q, CACHE, CACHE, CU, LENS, torch.tensor([[7, 1]], dtype=torch.int32), 0.3)),
    ("paged_attention keys past the table", lambda: mok.paged_attention(
        Q, CACHE, CACHE, CU, torch.tensor([9], dtype=torch.int32), TABLE, 0.3)),
    ("write_kv_cache slot out of range", lambda: mok.write_kv_cache(K, K, CACHE.clone(), CACHE.clone(),
                                                                     torch.tensor([0, 1, 2, 12]))),
    ("write_kv_cache slot twice", lambda: mok.write_kv_cache(K, K, CACHE.clone(), CACHE.clone(),
                                                              torch.tensor([0, 1, 1, 3]))),
    ("write_kv_cache slots float", lambda: mok.write_kv_cache(K, K, CACHE.clone(), CACHE.clone(), torch.zeros(T))),
    ("write_kv_cache k None", lambda: mok.write_kv_cache(None, K, CACHE.clone(), CACHE.clone(), torch.arange(T))),
    ("log_softmax int64", lambda: mok.log_softmax(X.long())),
    ("logprobs ids out of range", lambda: mok.logprobs(X, torch.full((T,), 99))),
    ("logprobs sparse ids", lambda: mok.logprobs(X, torch.zeros(T, dtype=torch.long).to_sparse())),
    ("rotary theta nan", lambda: mok.rotary(Q, torch.arange(T), math.nan)),
    ("rotary positions float", lambda: mok.rotary(Q, torch.arange(T).float(), 1e4)),
    ("MoE hidden_size 0", lambda: mok.MoE(0, 8, 6, 2)),
    ("route renormalize 'no'", lambda: mok.route(LOGITS, 2, renormalize="no")),
]


def _moe_double_backward():
    hidden = X.clone().requires_grad_()
    out = mok.moe(hidden, LOGITS, W13, W2, 2)
    grad, = torch.autograd.grad(out.square().sum(), hidden, create_graph=True)
    grad.sum().backward()


@pytest.mark.parametrize(("name", "call"), MOK_API, ids=[_rl_id(e) for e in MOK_API])
def test_mok_ops_raise_unsupported_error(name, call):
    with pytest.raises(mok.UnsupportedError):
        call()
