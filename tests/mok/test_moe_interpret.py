"""Logic of the MoE Triton kernels (mok/kernels/moe/) under TRITON_INTERPRET=1 on CPU tensors.

The cases run in one child process (this file run as a script, through the `triton_interpret` fixture of
tests/conftest.py) and pytest checks each case's verdict. Tiny shapes. Expected values come from the CPU
reference path (mok/reference/moe.py); GEMM accumulation orders differ (numpy inside the interpreter),
hence bf16-ulp tolerances, while routing, the schedule and every piece of index logic must match exactly.
"""
from __future__ import annotations

import contextlib
import sys

import pytest

from tests.helpers.interpret import Cases, run_cases

CASES = Cases()
case = CASES.case


# ---------------------------------------------------------------------------------------------
# cases (run in the child)

# (T, H, I, E, K): a tiny shape, odd sizes that exercise every mask, one token, and
# more experts than tokens (empty experts).
SHAPES = [(5, 64, 32, 4, 2), (7, 40, 24, 6, 3), (1, 33, 17, 5, 2), (3, 64, 32, 16, 4)]


def _inputs(num_tokens, hidden, inter, num_experts, seed=0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).bfloat16()
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).bfloat16()
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5).bfloat16()
    return x, logits, w13, w2


def _close(actual, expected, label, tol=2e-2):
    import torch

    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (label, actual.shape, expected.shape)
    scale = max(1.0, expected.float().abs().max().item())
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol * scale, rtol=tol, msg=label)


@case
def route_matches_reference_and_breaks_ties_low():
    import torch

    from mok.kernels.moe import layer as kernels
    from mok.reference import moe as reference

    for num_experts, top_k, renorm in ((4, 2, True), (123, 8, True), (6, 6, False), (8, 1, True)):
        logits = torch.randn(9, num_experts, generator=torch.Generator().manual_seed(num_experts)) * 2
        logits[0] = 1.0  # all tied
        logits[1, ::2] = 4.0  # ties among the largest
        ids, weights, probs = kernels.route(logits, top_k, renorm)
        ref_ids, ref_weights, ref_probs = reference.route(logits, top_k, renorm)
        assert torch.equal(ids, ref_ids), (num_experts, ids, ref_ids)
        _close(probs, ref_probs, "probs", 1e-5)
        _close(weights, ref_weights, "weights", 1e-5)
        assert ids[0].tolist() == list(range(top_k))
        replay, _ = kernels.replay_weights(logits, ids, renorm)
        assert torch.equal(replay, weights)
    bf16_logits = torch.randn(4, 8).bfloat16()
    assert torch.equal(kernels.route(bf16_logits, 2, True)[0], reference.route(bf16_logits, 2, True)[0])


@case
def schedule_and_tiles_are_exact():
    import torch

    from mok.kernels.moe.schedule import Schedule
    from mok.reference import moe as reference

    gen = torch.Generator().manual_seed(1)
    for num_tokens, num_experts, top_k in ((5, 4, 2), (37, 9, 3), (1, 16, 4), (64, 3, 1)):
        ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]).int()
        sched = Schedule(ids, num_experts)
        slots, start = reference.schedule(ids, num_experts)
        assert torch.equal(sched.sorted_slots_N.long(), slots) and torch.equal(sched.expert_start.long(), start)
        for block_m in (1, 4, 16):
            tile_expert, row_start, num_tiles, max_tiles = sched.tiles(block_m)
            # expected tiles: for each non-empty expert, ceil(count / BM) tiles from its start
            expected = [(e, int(start[e]) + j * block_m) for e in range(num_experts)
                        for j in range(-(-int(start[e + 1] - start[e]) // block_m))]
            assert int(num_tiles) == len(expected) <= max_tiles
            got = list(zip(tile_expert.tolist(), row_start.tolist()))[:len(expected)]
            assert got == expected, (block_m, got, expected)


@case
def schedule_kernel_equals_torch_schedule():
    """The one-launch schedule (small batches) and the torch path give the same integers."""
    import torch

    from mok.kernels.moe import configs
    from mok.kernels.moe.schedule import Schedule

    gen = torch.Generator().manual_seed(7)
    for num_tokens, num_experts, top_k in ((5, 4, 2), (37, 9, 3), (1, 16, 4), (70, 3, 1), (9, 300, 8)):
        ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]).int()
        saved = configs.SCHEDULE_KERNEL_MAX_SLOTS
        fast = Schedule(ids, num_experts, block_m=4)
        configs.SCHEDULE_KERNEL_MAX_SLOTS = 0
        try:
            slow = Schedule(ids, num_experts)
            slow_tiles = {bm: slow.tiles(bm) for bm in (1, 4, 16)}
        finally:
            configs.SCHEDULE_KERNEL_MAX_SLOTS = saved
        assert fast._use_kernel and not slow._use_kernel
        assert (torch.equal(fast.sorted_slots_N, slow.sorted_slots_N)
                and torch.equal(fast.expert_start, slow.expert_start))
        given = Schedule(ids, num_experts, slow.sorted_slots_N.long(), slow.expert_start.long())
        for sched in (fast, given):
            for block_m, want in slow_tiles.items():
                got = sched.tiles(block_m)
                assert got[3] == want[3] and all(torch.equal(a, b) for a, b in zip(got[:3], want[:3])), block_m


@case
def tma_descriptors_take_every_path_and_match():
    """TMA on (bf16, aligned shapes): every descriptor path (weights [N, K] and [K, N], contiguous A
    rows) runs and gives the reference's rows and gradients; misaligned shapes fall back to pointers."""
    import torch

    from mok.kernels.moe import layer as kernels
    from mok.kernels.moe.configs import CONFIGS
    from mok.reference import moe as reference

    with _descriptor_spy() as used:
        for shape, block_k in (((40, 64, 32, 8, 2), 32), (SHAPES[0], 64), (SHAPES[2], 32)):
            used.clear()
            configs = {name: dict(cfg, TMA=1, BLOCK_K=block_k) for name, cfg in CONFIGS["small"].items()}
            configs["gemm1"]["BLOCK_N"] = 16
            got, want, (x, w13, w2, ids, weights) = _forward_pair(shape, configs, seed=8)
            for label, a, b in zip(("out", "gate_up", "act", "y"), got[:4], want[:4]):
                _close(a, b, f"{shape} {label}")
            grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(9)).bfloat16()
            back = kernels.moe_backward(grad_out, x, w13, w2, ids, weights, *want[1:], configs=configs)
            expected = reference.moe_backward(grad_out, x, w13, w2, ids, weights, *want[1:])
            for label, a, b in zip(("d hidden", "d w13", "d w2", "d weights"), back, expected):
                _close(a, b, f"{shape} {label}")
            num_experts, two_inter, hidden = w13.shape
            aligned = hidden % 8 == 0 and two_inter % 16 == 0
            if aligned:  # gemm1 w13, gemm2 act + w2, bwd_act w2 [K, N], bwd_dx d gate_up + w13 [K, N],
                # weight grads: act (d w2's B) and d gate_up (d w13's A), full row chunks
                assert len(used) == 8, used
                assert ((num_experts * two_inter, hidden), (16, block_k)) in used
                block_m, block_n = configs["weight_grad"]["BLOCK_M"], configs["weight_grad"]["BLOCK_N"]
                assert ((x.shape[0] * ids.shape[1], two_inter), (block_k, block_m)) in used
                assert ((x.shape[0] * ids.shape[1], two_inter // 2), (block_k, block_n)) in used
            else:
                assert not used, used


@case
def backward_layouts_and_weight_grad_tma_match():
    """SORTED_DY / SORTED_X (rows moved into schedule order) and weight_grad TMA (full row chunks
    through descriptors, tail through pointers; BLOCK_K below and above an expert's rows) give the
    reference's gradients, with every descriptor in use (both weight-grad operands contiguous)."""
    import torch

    from mok.kernels.moe import layer as kernels
    from mok.kernels.moe.configs import CONFIGS
    from mok.reference import moe as reference

    with _descriptor_spy() as used:
        shape = (64, 64, 32, 4, 2)  # ~32 rows per expert: full chunks of 16 and 32 and partial tails
        base = {name: dict(cfg) for name, cfg in CONFIGS["small"].items()}
        variants = [
            {"bwd_act": dict(base["bwd_act"], SORTED_DY=1, TMA=1, BLOCK_K=32)},
            {"weight_grad": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, TMA=1, SORTED_DY=1, SORTED_X=1,
                                 num_warps=4, num_stages=2)},
            {"weight_grad": dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=32, TMA=1, SORTED_X=1, num_warps=4, num_stages=2)},
        ]
        for override in variants:
            used.clear()
            _, want, (x, w13, w2, ids, weights) = _forward_pair(shape, seed=11)
            grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(12)).bfloat16()
            got = kernels.moe_backward(grad_out, x, w13, w2, ids, weights, *want[1:], configs=override)
            expected = reference.moe_backward(grad_out, x, w13, w2, ids, weights, *want[1:])
            for label, a, b in zip(("d hidden", "d w13", "d w2", "d weights"), got, expected):
                _close(a, b, f"{override} {label}")
            # rerunning the stages one by one gives the same bits as moe_backward
            backward = kernels.BackwardStages(grad_out, x, w13, w2, ids, weights, *want[1:], configs=override)
            names = [name for name, _ in backward.stages]
            assert ("row_of_slot" in names) == any(c.get("SORTED_DY") for c in override.values()), names
            assert ("gather_x" in names) == bool(override.get("weight_grad", {}).get("SORTED_X")), names
            for _, run in backward.stages:
                run()
            assert all(torch.equal(a, b) for a, b in zip(backward.result(), got))
            num_slots = x.shape[0] * ids.shape[1]
            wg = override.get("weight_grad")
            if wg is not None:
                assert ((num_slots, w13.shape[1]), (wg["BLOCK_K"], wg["BLOCK_M"])) in used, used
                if wg.get("SORTED_X"):
                    assert ((num_slots, x.shape[1]), (wg["BLOCK_K"], wg["BLOCK_N"])) in used, used
                if wg.get("SORTED_DY"):
                    assert ((num_slots, x.shape[1]), (wg["BLOCK_K"], wg["BLOCK_M"])) in used, used
            else:  # bwd_act with d y in schedule order: its A rows through a descriptor
                assert ((num_slots, x.shape[1]), (override["bwd_act"]["BLOCK_M"], 32)) in used, used


@contextlib.contextmanager
def _descriptor_spy():
    """Records (tensor shape, block shape) of every TMA descriptor the kernels build, while active."""
    from mok.kernels.moe import grouped_gemm

    used = []
    original = grouped_gemm._descriptor

    def spy(t2d, block_shape):
        used.append((tuple(t2d.shape), tuple(block_shape)))
        return original(t2d, block_shape)

    grouped_gemm._descriptor = spy
    try:
        yield used
    finally:
        grouped_gemm._descriptor = original


def _forward_pair(shape, configs=None, seed=0):
    from mok.kernels.moe import layer as kernels
    from mok.reference import moe as reference

    num_tokens, hidden, inter, num_experts, top_k = shape
    x, logits, w13, w2 = _inputs(num_tokens, hidden, inter, num_experts, seed)
    ids, weights, _ = reference.route(logits, top_k, True)
    got = kernels.moe_forward(x, w13, w2, ids, weights, True, configs)
    want = reference.moe_forward(x, w13, w2, ids, weights)
    return got, want, (x, w13, w2, ids, weights)


@case
def forward_matches_reference():
    import torch

    for shape in SHAPES:
        got, want, _ = _forward_pair(shape)
        for label, a, b in zip(("out", "gate_up", "act", "y"), got[:4], want[:4]):
            _close(a, b, f"{shape} {label}")
        assert torch.equal(got[4], want[4]) and torch.equal(got[5], want[5])


@case
def forward_without_saving_gives_the_same_output():
    import torch

    from mok.kernels.moe import layer as kernels

    got, _, (x, w13, w2, ids, weights) = _forward_pair(SHAPES[1])
    plain = kernels.moe_forward(x, w13, w2, ids, weights, False)
    assert torch.equal(plain[0], got[0]) and plain[1].shape[0] == 0


@case
def forward_is_the_same_for_every_tile_config():
    """Every config of CONFIGS (and odd tile sizes) must give rows matching the reference; under the
    interpreter each tile's dot is a numpy matmul, so bits may differ by config here (the bitwise
    proof runs on the GPU in test_moe_gpu.py)."""
    from mok.kernels.moe.configs import CONFIGS

    overrides = [dict(CONFIGS[size]) for size in CONFIGS]
    overrides.append({
        "gemm1": dict(BLOCK_M=32, BLOCK_N=16, GROUP_M=3, num_warps=4, num_stages=2),
        "gemm2": dict(BLOCK_M=32, BLOCK_N=32, GROUP_M=2, num_warps=4, num_stages=2),
    })
    for configs in overrides:
        got, want, _ = _forward_pair(SHAPES[1], configs, seed=2)
        for label, a, b in zip(("out", "gate_up", "act", "y"), got[:4], want[:4]):
            _close(a, b, label)


@case
def backward_matches_reference():
    import torch

    from mok.kernels.moe import layer as kernels
    from mok.kernels.moe.configs import CONFIGS
    from mok.reference import moe as reference

    for shape in SHAPES:
        for configs in (None, dict(CONFIGS["small"])):
            _, want, (x, w13, w2, ids, weights) = _forward_pair(shape, seed=3)
            grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(4)).bfloat16()
            # feed both the reference's saved tensors: differences are then summation order only
            got = kernels.moe_backward(grad_out, x, w13, w2, ids, weights, *want[1:], configs=configs)
            expected = reference.moe_backward(grad_out, x, w13, w2, ids, weights, *want[1:])
            for label, a, b in zip(("d hidden", "d w13", "d w2", "d weights"), got, expected):
                _close(a, b, f"{shape} {label}")
            unused = [e for e in range(w13.shape[0]) if not bool((ids == e).any())]
            assert all(bool((got[1][e] == 0).all()) and bool((got[2][e] == 0).all()) for e in unused)


@case
def forward_rows_are_batch_invariant_in_the_kernel_logic():
    """A token alone and inside a permuted batch: same experts, same rows up to the interpreter's
    per-tile numpy dot (close), and the combine/index logic never mixes rows."""
    import torch

    from mok.kernels.moe import layer as kernels
    from mok.reference import moe as reference

    x, logits, w13, w2 = _inputs(12, 40, 24, 4, seed=5)
    ids, weights, _ = kernels.route(logits, 2, True)
    full = kernels.moe_forward(x, w13, w2, ids, weights, False)[0]
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(6))
    permuted = kernels.moe_forward(x[perm], w13, w2, ids[perm], weights[perm], False)[0]
    _close(permuted, full[perm], "permuted")
    for t in (0, 11):
        alone = kernels.moe_forward(x[t:t + 1], w13, w2, ids[t:t + 1], weights[t:t + 1], False)[0]
        _close(alone[0], full[t], f"alone {t}")
    ref_ids, _, _ = reference.route(logits, 2, True)
    assert torch.equal(ids, ref_ids)


# ---------------------------------------------------------------------------------------------
# pytest side


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_logic_under_interpreter(triton_interpret, name):
    assert triton_interpret.verdicts(__file__).get(name) == "ok", triton_interpret.verdicts(__file__).get(
        name, "case did not run")


if __name__ == "__main__":
    sys.exit(run_cases(CASES))
