"""Launch decisions taken on the host, checked without a GPU: when the cached launch path hands a launch to
Triton, what a launch plan replays and when it refuses, when a kernel launches with programmatic dependent launch
(mok/kernels/launch.py), when GEMM 2 prefetches its weights before its wait, how the grouped GEMMs' lean epilogue
addresses C, which MoE configs a layer's sizes pick, and which tiles mok.linear picks. (What they do on the H200:
the gpu tests below, tests/mok/test_moe_gpu.py, tests/mok/test_dense_gpu.py.)"""
from __future__ import annotations

import types

import pytest
import torch
import triton
import triton.language as tl

from mok.kernels import launch
from mok.kernels import linear as linear_kernels
from mok.kernels.moe import configs, grouped_gemm
from mok.kernels.moe.schedule import ScannedRoutes, Schedule

CUDA = torch.device("cuda", 0)  # a device object only: nothing runs on it here


@pytest.fixture
def hopper(monkeypatch):
    """pdl_options as on an H200 (132 SMs) outside the interpreter."""
    monkeypatch.setattr(launch, "INTERPRET", False)
    monkeypatch.setattr(launch, "_pdl_min_programs", lambda device_index: 132)


def test_pdl_options_follow_the_device_the_grid_and_the_switch(hopper, monkeypatch):
    assert launch.pdl_options(CUDA) == {"PDL": True, "launch_pdl": True}
    assert launch.pdl_options(CUDA, num_programs=132)["launch_pdl"]
    assert launch.pdl_options(CUDA, num_programs=128) == {"PDL": False}
    assert launch.pdl_options(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setattr(launch, "PDL_ENABLED", False)
    assert launch.pdl_options(CUDA) == {"PDL": False}
    monkeypatch.setattr(launch, "PDL_ENABLED", True)
    monkeypatch.setattr(launch, "_pdl_min_programs", lambda device_index: None)  # before Hopper
    assert launch.pdl_options(CUDA) == {"PDL": False}
    monkeypatch.setattr(launch, "INTERPRET", True)
    monkeypatch.setattr(launch, "_pdl_min_programs", lambda device_index: 132)
    assert launch.pdl_options(CUDA) == {"PDL": False}


class _TritonKernelStandIn:
    """Stands in for a JITFunction: records the launches that go through Triton's own path."""

    pre_run_hooks: list = []
    debug = None

    def __init__(self):
        self.triton_launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.triton_launches.append(grid)


def test_cached_launch_hands_to_triton_when_it_cannot_key_the_launch(monkeypatch):
    """A callable grid, Triton's launch hooks or the kernel's pre-run hooks (profilers), a debug kernel or the switch
    off: Triton's own launch, not the cache."""
    kernel = _TritonKernelStandIn()
    cached = launch.CachedLaunch(kernel)
    cached[lambda meta: (1,)](1, 2)
    assert not launch._launch_hooks_set()  # Triton's empty hook chains (its default) are no hooks
    hook = lambda metadata: None  # noqa: E731
    triton.knobs.runtime.launch_exit_hook.add(hook)  # how profilers register
    try:
        cached[(3,)](1, 2)
    finally:
        triton.knobs.runtime.launch_exit_hook.remove(hook)
    monkeypatch.setattr(kernel, "pre_run_hooks", [lambda *args, **kwargs: None])
    cached[(5,)](1, 2)
    monkeypatch.setattr(kernel, "pre_run_hooks", [])
    monkeypatch.setattr(triton.knobs.runtime, "debug", True)  # Triton compiles a debug kernel: not the cached one
    cached[(6,)](1, 2)
    monkeypatch.setattr(triton.knobs.runtime, "debug", False)
    cached[(7,)](1, 2, debug=True)
    monkeypatch.setattr(launch, "CACHED_LAUNCH_ENABLED", False)
    cached[(4,)](1, 2)
    assert len(kernel.triton_launches) == 6 and kernel.triton_launches[1:] == [(3,), (5,), (6,), (7,), (4,)]
    assert not cached._launchers


def test_a_launch_through_triton_leaves_its_recording_unreplayable():
    kernel = _TritonKernelStandIn()
    with launch.record_launches() as recording:
        launch.CachedLaunch(kernel)[lambda meta: (1,)](1, 2)
    assert kernel.triton_launches and not recording.replayable and not recording.launches
    assert launch.LaunchPlan.build(recording, per_call=(), stable=()) is None
    assert getattr(launch._recordings, "active", None) is None


def test_a_recording_inside_a_recording_leaves_the_outer_one_unreplayable():
    """The outer recording does not see the launches made inside an inner one (a plan cache's first call inside
    another's): replaying it would skip them."""
    found = launch._Compiled(run=None, function=5, packed_metadata=(), direct=print, cooperative=False, pdl=False)
    with launch.record_launches() as outer:
        outer.add(found, (1, 1, 1), ())
        with launch.record_launches() as inner:
            inner.add(found, (1, 1, 1), ())
        assert inner.replayable and launch._recordings.active is outer
    assert not outer.replayable and len(outer.launches) == 1


def test_a_torch_op_other_than_allocations_and_views_leaves_its_recording_unreplayable():
    """A replay makes only the recorded launches: device work done by a torch op inside the recording would be
    missing from it."""
    with launch.record_launches() as recording:
        buffer = torch.empty(64, dtype=torch.uint8)
        buffer[16:48].view(torch.float32).view(2, 4).t()
    assert recording.replayable
    for work in (lambda t: t.add_(1), lambda t: t.float(), lambda t: t.clone(), lambda t: t.clamp(-1, 1),
                 lambda t: torch.zeros_like(t)):
        ids = torch.zeros(4, dtype=torch.int64)
        with launch.record_launches() as recording:
            work(ids)
        assert not recording.replayable


def _plan_recording(args, direct=None) -> launch.Recording:
    found = launch._Compiled(run=None, function=5, packed_metadata=(4, 1, 0), direct=direct, cooperative=False,
                             pdl=True)
    recording = launch.Recording()
    recording.add(found, (2, 1, 1), args)
    return recording


def test_launch_plan_replays_with_each_calls_addresses(monkeypatch):
    """A recorded launch replayed: an argument inside a per-call tensor gets the replaying call's address plus its
    recorded offset, one inside a stable tensor's storage keeps its address, a tensor without elements stays 0 (torch
    gives it no address), other arguments stay as recorded; the
    C launch function gets Triton's launcher arguments (grid, stream, function, cooperative, PDL, no scratch, the
    kernel's metadata, no launch hooks)."""
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    launches = []
    x, out, weights, workspace = torch.zeros(8), torch.zeros(4), torch.zeros(16), torch.zeros(32)
    recording = _plan_recording([x[2:], weights, workspace[8:].view(4, 6), 7, None, out, workspace[32:]],
                                direct=lambda *args: launches.append(args))
    plan = launch.LaunchPlan.build(recording, per_call=(x, out), stable=(weights, workspace))
    del workspace  # the plan keeps its storage
    for _ in range(2):
        x2, out2 = torch.zeros(8), torch.zeros(4)
        plan.launch((x2, out2))
        assert launches[-1][:13] == (2, 1, 1, 77, 5, False, True, None, None, (4, 1, 0), None, None, None)
        stable_at = recording.launches[0].args[2].data_ptr()
        assert launches[-1][13:] == (x2.data_ptr() + 8, weights.data_ptr(), stable_at, 7, None, out2.data_ptr(), 0)
    with launch.record_launches() as outer:  # a recording cannot see a replay's launches
        plan.launch((x2, out2))
    assert not outer.replayable


def test_launch_plan_export_gives_the_bits_tritons_launcher_passes():
    """LaunchPlan.export, what the native eager path replays: per launch the function, grid, threads (32 per warp),
    shared memory, cooperative and PDL flags, and every argument the compiled kernel takes in order: a per-call
    tensor as (offset, its index), a stable address, ints in their width (two's complement), an fp32 as its float's
    bits, constexprs (an int specialized to 1 among them) left out, then two null scratch pointers. None for what
    the native path does not pass: a tuple argument, an fp16 scalar, a cluster of CTAs, an unknown signature."""
    import struct

    x, out, weights = torch.zeros(8), torch.zeros(4), torch.zeros(16)
    signature = ("*fp32", "*fp32", "*bf16", "i32", "i64", "constexpr", "fp32", "i1", "constexpr")

    def exported(signature, args, packed_metadata=(8, 1, 1024)):
        found = launch._Compiled(run=None, function=5, packed_metadata=packed_metadata, direct=print,
                                 cooperative=False, pdl=True, signature=signature)
        recording = launch.Recording()
        recording.add(found, (3, 2, 1), args)
        return launch.LaunchPlan.build(recording, per_call=(x, out), stable=(weights,)).export()

    plan = exported(signature, [x[2:], out, weights, -3, 2**40, 1, 1e-6, True, 128])
    fp32_bits = struct.unpack("<I", struct.pack("<f", 1e-6))[0]
    assert plan == [(5, (3, 2, 1), 256, 1024, False, True,
                     [(8, 0), (0, 1), (weights.data_ptr(), -1), (2**32 - 3, -1), (2**40, -1), (fp32_bits, -1),
                      (1, -1), (0, -1), (0, -1)])]
    assert exported(signature[:3] + (("i32", "i32"),) + signature[4:], [x, out, weights, (1, 2), 0, 1, 1.0, 1,
                                                                        1]) is None
    assert exported(("*fp32", "fp16"), [x, 1.0]) is None
    assert exported(("*fp32",), [x], packed_metadata=(4, 2, 0)) is None
    assert exported(None, [x]) is None


def test_launch_plan_exports_host_tensor_descriptors_as_tritons_launcher_expands_them():
    """A launch taking host tensor descriptors (mok.linear's TMA loads) has no direct launch: its plan is export-only
    (Python's replay refuses it). Exported, a descriptor is what Triton 3.6's launcher makes of it: the tensor map,
    encoded from the descriptor's base (a per-call tensor: offset and index) with the compiled kernel's swizzle, host
    data type, element bytes and block, the OOB fill (NaN padding: 1) and the descriptor's shape and strides; then
    the shape as i32 and the strides as i64. No plan for Python's replay; None for fp4-padded descriptors."""
    from types import SimpleNamespace

    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

    x, out = torch.zeros(64, 32, dtype=torch.bfloat16), torch.zeros(4)
    view = x[8:]  # 8 rows of 32 bf16 in: 512 bytes
    descriptor = SimpleNamespace(base=view, shape=[56, 32], strides=[32, 1], block_shape=[16, 32], padding="nan")
    meta = {"swizzle": 3, "elem_size": 2, "elem_type": 9, "block_size": [16, 32], "fp4_padded": False}
    signature = ("*bf16", "tensordesc<bf16[16, 32]>", "i32", "*fp32")

    def recording(meta=meta):
        found = launch._Compiled(run=None, function=5, packed_metadata=(4, 1, 0), direct=None, cooperative=False,
                                 pdl=False, signature=signature, descriptors=(meta,))
        recorded = launch.Recording()
        recorded.add(found, (7, 1, 1), [x, descriptor, 56, out])
        return recorded

    assert recording().replayable and launch.LaunchPlan.build(recording(), (x, out), ()) is None
    plan = launch.LaunchPlan.build(recording(), (x, out), (), for_export=True)
    with pytest.raises(RuntimeError, match="native path"):
        plan.launch((x, out))
    encoding = (TMA_DTYPE_DEVICE_TO_HOST[9], 3, 2, 1, (16, 32), (56, 32), (32, 1))
    assert plan.export() == [(5, (7, 1, 1), 128, 0, False, False,
                              [(0, 0), (512, 0, encoding), (56, -1), (32, -1), (32, -1), (1, -1), (56, -1), (0, 1),
                               (0, -1), (0, -1)])]
    padded = launch.LaunchPlan.build(recording(dict(meta, fp4_padded=True)), (x, out), (), for_export=True)
    assert padded.export() is None


def test_plans_launch_directly_only_with_triton_36s_launcher_layout(monkeypatch):
    """LaunchPlan passes the C launch function Triton 3.6's arguments; under another layout a compiled kernel gets
    no direct launch, so no plan."""
    from triton.backends.nvidia import driver

    class Run:
        launch = print  # a builtin, as the C launch function is
        global_scratch_size = profile_scratch_size = 0

    class Compiled:
        run, function, packed_metadata = Run(), 5, (4, 1, 0)

    class WrappedRun(Run):
        launch = staticmethod(lambda *args: None)  # Python: the wrapper that encodes tensor descriptors

    meta = {"swizzle": 3, "elem_size": 2, "elem_type": 9, "block_size": [16, 32], "fp4_padded": False}

    class WithDescriptors(Compiled):
        run = WrappedRun()
        src = types.SimpleNamespace(signature={"x": "*bf16", "x_desc": "tensordesc<bf16[16, 32]>", "N": "constexpr"})
        metadata = types.SimpleNamespace(tensordesc_meta=[meta])

    for layout, direct in (("iiiKKppOOOOOO", True), ("iiiKKppOOOOOOOO", False)):
        monkeypatch.setattr(driver, "_BASE_ARGS_FORMAT", layout, raising=False)  # (Triton 3.9 has none)
        launch._direct_launch_layout.cache_clear()
        assert (launch._compiled(Compiled()).direct is not None) == direct
        with_descriptors = launch._compiled(WithDescriptors())  # no direct launch; export-only where the layout is
        assert with_descriptors.direct is None and with_descriptors.descriptors == ((meta,) if direct else None)
        assert with_descriptors.signature == ("*bf16", "tensordesc<bf16[16, 32]>", "constexpr")
    launch._direct_launch_layout.cache_clear()


def test_launch_plan_refuses_what_a_replay_cannot_give():
    """No plan when a launch read a temporary of the recorded call, an argument lies inside two per-call tensors, a
    kernel's launcher adds to the C launch (scratch memory, tensor descriptors: no direct launch), or nothing was
    recorded."""
    x, weights, temporary = torch.zeros(8), torch.zeros(16), torch.zeros(4)
    direct = print  # any builtin: never called here
    assert launch.LaunchPlan.build(_plan_recording([x, temporary], direct), (x,), (weights,)) is None
    assert launch.LaunchPlan.build(_plan_recording([x[4:]], direct), (x, x[2:]), (weights,)) is None
    no_direct = _plan_recording([x, weights])
    assert not no_direct.replayable and launch.LaunchPlan.build(no_direct, (x,), (weights,)) is None
    assert launch.LaunchPlan.build(launch.Recording(), (x,), (weights,)) is None
    assert launch.LaunchPlan.build(_plan_recording([x, weights], direct), (x,), (weights,)) is not None


def test_plan_cache_records_the_first_call_of_a_key_and_replays_the_rest(monkeypatch):
    """PlanCache: a key's first call runs inside a recording and keeps its plan, later calls replay it; a key whose
    recording gave no plan runs every call (remembered, not recorded again); the least recently used key goes past
    the capacity; capacity 0 runs every call unrecorded. launch_planned keys by device and tensors besides."""
    replays, runs = [], []
    monkeypatch.setattr(launch.LaunchPlan, "launch", lambda plan, per_call: replays.append(per_call))
    found = launch._Compiled(run=None, function=5, packed_metadata=(), direct=print, cooperative=False, pdl=False)

    def site(x, replayable=True):
        def run():
            recording = getattr(launch._recordings, "active", None)
            runs.append(recording is not None)  # whether this call was recorded
            if recording is not None:
                recording.add(found, (1, 1, 1), (x,))
                recording.replayable = recording.replayable and replayable
            return ()
        return run

    cache = launch.PlanCache(2)
    x = torch.zeros(4)
    for _ in range(3):
        cache.call(("a",), (x,), site(x))
    assert runs == [True] and len(replays) == 2
    for _ in range(2):
        cache.call(("refused",), (x,), site(x, replayable=False))
    assert runs == [True, True, False] and cache.plans[("refused",)] is None and len(replays) == 2
    cache.call(("a",), (x,), site(x))  # a replay: "a" becomes the most recent
    cache.call(("c",), (x,), site(x))  # past the capacity: "refused", the least recently used, goes
    assert list(cache.plans) == [("a",), ("c",)] and len(replays) == 3
    cache.capacity = 0
    cache.call(("d",), (x,), site(x))
    assert runs[-1] is False and ("d",) not in cache.plans

    def run_then_plans_off():  # another thread turns plans off during a call
        cache.capacity = 0
        return site(x)()

    cache.capacity = 2
    cache.call(("e",), (x,), run_then_plans_off)
    assert ("e",) in cache.plans and cache.capacity == 0
    cache.clear()
    assert not cache.plans

    monkeypatch.setattr(launch, "INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    meta_x = torch.empty(4, 2, device="meta")  # is_cuda False: run directly
    cache = launch.PlanCache(4)
    launch.launch_planned(cache, ("site",), (meta_x,), site(meta_x))
    assert not cache.plans and runs[-1] is False
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    for _ in range(2):  # a launch's own return value (Triton's compiled kernel, the first time) is not kept
        launch.launch_planned(cache, ("site", 1e-6), (x,), lambda: (site(x)(), found)[1])
    assert list(cache.plans) == [("site", 1e-6, 3, ((x.device, x.shape, x.stride(), x.dtype, x.data_ptr() % 16),))]
    assert runs[-1] is True and len(replays) == 4


@launch.cached_launch
@triton.jit
def _scaled_copy_kernel(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * scale, mask=offs < n)


@pytest.mark.gpu
def test_cached_launch_keys_the_specialization_and_gives_tritons_bits():
    """Aligned and misaligned pointers, n divisible by 16 or not, other constexprs: each specialization gets its own
    compiled kernel (a misaligned view must not reuse the aligned one's vector loads), launching them again finds
    them in the cache, and every launch writes what Triton's own launch of the same kernel writes."""
    base = torch.randn(4099, device="cuda")
    cases = ((base[:4096], 256), (base[1:4097], 256), (base[3:4098], 256), (base[:4096], 128), (base[:4095], 256))
    for round_ in range(2):
        for x, block in cases:
            got, want = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
            grid = (triton.cdiv(x.numel(), block),)
            _scaled_copy_kernel[grid](x, got, x.numel(), 0.5, BLOCK=block)
            _scaled_copy_kernel.kernel[grid](x, want, x.numel(), 0.5, BLOCK=block)
            assert torch.equal(got, want) and torch.equal(got, x * 0.5)
        if round_ == 0:
            keys = set(_scaled_copy_kernel._launchers)
    assert set(_scaled_copy_kernel._launchers) == keys  # the second round only hit the cache
    x_specs = {key[1] for key in keys}  # key: (device, x's specialization, out's, ...)
    assert len(x_specs) == 2 and ("*fp32", "D") in x_specs  # aligned (16 bytes) and not
    assert {key[-1] for key in keys} == {("constexpr", 256), ("constexpr", 128)}
    assert len({key[3] for key in keys}) == 2  # n = 4096 (divisible by 16) and 4095


class _RecordedLaunches:
    """Stands in for a Triton kernel: `kernel[grid](*args, **kwargs)` records (grid, kwargs)."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, kwargs))


@pytest.mark.parametrize("scanned,pdl,prefetch", [(True, True, 128), (False, True, 0), (True, False, 0)])
def test_gemm2_prefetches_only_scanning_the_routes_with_pdl(monkeypatch, scanned, pdl, prefetch):
    """The prefetch guesses its tile from the ids before the PDL wait: only when the rows come from the ids (a
    schedule's tiles may come from the launch just before) and only when the kernel waits at all."""
    kernel = _RecordedLaunches()
    monkeypatch.setattr(grouped_gemm, "_grouped_gemm_kernel", kernel)
    monkeypatch.setattr(grouped_gemm, "pdl_options",
                        lambda device, num_programs=None: dict(PDL=True, launch_pdl=True) if pdl else dict(PDL=False))
    monkeypatch.setattr(configs, "SCHEDULE_KERNEL_MAX_SLOTS", 0)  # the torch schedule: no kernel runs here
    num_experts, hidden, inter, top_k = 8, 256, 128, 2
    ids_TK = torch.tensor([[3, 5]], dtype=torch.int32)
    schedule = ScannedRoutes(ids_TK, num_experts) if scanned else Schedule(ids_TK, num_experts)
    w2_EHI = torch.zeros(num_experts, hidden, inter, dtype=torch.bfloat16)
    act_NI = torch.zeros(2, inter, dtype=torch.bfloat16)
    y_NH = torch.empty(2, hidden, dtype=torch.bfloat16)
    gemm2 = configs.CONFIGS["decode"]["gemm2"]
    assert gemm2["PREFETCH_K"] == 128
    grouped_gemm.launch_gemm2(act_NI, w2_EHI, y_NH, schedule, top_k, gemm2)
    (_, kwargs), = kernel.launches
    assert kwargs["PREFETCH_K"] == prefetch and kwargs["PDL"] == pdl
    assert kwargs["LINE"] == 64  # bf16 elements per 128-byte line


@pytest.mark.parametrize("rows,lean,expected", [(2 ** 20, 1, 2), (2 ** 20 - 1, 1, 1), (2 ** 20, 0, 0), (16, 2, 2)])
def test_lean_epilogue_takes_row_bases_where_int32_offsets_could_wrap(monkeypatch, rows, lean, expected):
    """LEAN_EPILOGUE 1 (int32 offsets) becomes 2 (int64 row bases) where C holds 2^31 elements or more: here y of
    2^20 rows of 2048 (a meta tensor: no memory)."""
    kernel = _RecordedLaunches()
    monkeypatch.setattr(grouped_gemm, "_grouped_gemm_kernel", kernel)
    num_experts, hidden, inter, top_k = 8, 2048, 128, 2
    schedule = ScannedRoutes(torch.tensor([[3, 5]], dtype=torch.int32), num_experts)
    w2_EHI = torch.zeros(num_experts, hidden, inter, dtype=torch.bfloat16)
    act_NI = torch.zeros(2, inter, dtype=torch.bfloat16)
    y_NH = torch.empty(rows, hidden, dtype=torch.bfloat16, device="meta")
    config = dict(BLOCK_M=16, BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=3, LEAN_EPILOGUE=lean)
    grouped_gemm.launch_gemm2(act_NI, w2_EHI, y_NH, schedule, top_k, config)
    (_, kwargs), = kernel.launches
    assert kwargs["LEAN_EPILOGUE"] == expected


@pytest.mark.parametrize("hidden,block_n", [(2048, 128), (4095, 128), (4096, 256), (7168, 256)])
def test_moe_configs_follow_the_hidden_size_in_the_large_class(hidden, block_n):
    """bwd_act's K loop runs over the hidden size: from configs.WIDE_HIDDEN the large class takes the wide tile;
    the other classes and kernels do not change with it."""
    num_slots, num_experts = 16384 * 8, 128  # 1024 rows per expert: the large class
    assert configs.size_class(num_slots, num_experts) == "large"
    picked = configs.pick_configs(num_slots, num_experts, hidden=hidden)
    assert picked["bwd_act"]["BLOCK_N"] == block_n
    assert {k: v for k, v in picked.items() if k != "bwd_act"} == {
        k: v for k, v in configs.CONFIGS["large"].items() if k != "bwd_act"}
    for size, slots in (("decode", 8), ("small", 128 * 64), ("xlarge", 16384 * 2)):
        experts = 8 if size == "xlarge" else num_experts
        assert configs.size_class(slots, experts) == size
        assert configs.pick_configs(slots, experts, hidden=hidden) == configs.CONFIGS[size]


@pytest.mark.parametrize("rows,cols,dtype,b_nk,entry", [
    (1, 2048, torch.bfloat16, True, "decode_n32"),  # o_proj
    (16, 5120, torch.bfloat16, True, "decode_n32"),  # qkv_proj, 16 rows
    (1, 151936, torch.bfloat16, True, "decode_n64"),  # lm_head: 64-column tiles still give 2374 programs
    (17, 2048, torch.bfloat16, False, "small"),  # a backward GEMM of 17 rows
    (64, 2048, torch.bfloat16, True, "decode_n32"),  # o_proj, a decode step of 64: 64 x 128 tiles give 16 programs
    (64, 5120, torch.bfloat16, True, "decode_n64"),  # qkv_proj, 64 rows: 320 programs of 16 x 64
    (256, 128, torch.bfloat16, True, "decode_n32"),  # a router of 128 experts, 256 rows
    (64, 151936, torch.bfloat16, True, "small"),  # lm_head, 64 rows: 1187 programs of 64 x 128
    (1023, 5120, torch.bfloat16, True, "small"),  # 16 x 40 programs
    (1024, 2048, torch.bfloat16, True, "large_b_nk"),
    (1, 64, torch.bfloat16, True, "narrow"),
    (1, 2048, torch.float32, True, "fp32"),
    (4096, 2048, torch.bfloat16, True, "large_b_nk"),
    (4096, 2048, torch.bfloat16, False, "large"),
])
def test_matmul_config_decode_tiles(rows, cols, dtype, b_nk, entry):
    assert linear_kernels.matmul_config(rows, cols, dtype, b_nk) is linear_kernels.CONFIGS[entry]
