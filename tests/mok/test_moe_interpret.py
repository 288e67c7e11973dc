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
    """The kernel-built schedule (small batches) and the torch path give the same integers."""
    import torch

    from mok.kernels.moe import configs
    from mok.kernels.moe.schedule import Schedule

    gen = torch.Generator().manual_seed(7)
    cases = [(5, 4, 2), (37, 9, 3), (1, 16, 4), (70, 3, 1), (9, 300, 8)]
    # the same with loops of several steps (sort chunks of 2 tokens at top-k 3, tile chunks of 2)
    steps = dict(sort_chunk_slots=8, tile_chunk=2, num_warps=1)
    for (num_tokens, num_experts, top_k), launch in [(c, None) for c in cases] + [(c, steps) for c in cases]:
        ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]).int()
        if num_experts > 4:  # the last experts empty: the last program still fills the tiles past num_tiles
            ids = ids.clamp(max=num_experts - 3)
        saved, saved_launch = configs.SCHEDULE_KERNEL_MAX_SLOTS, configs.SCHEDULE_KERNEL
        configs.SCHEDULE_KERNEL = launch or saved_launch
        try:
            fast = Schedule(ids, num_experts, block_m=4)
            fast_tiles = {bm: fast.tiles(bm) for bm in (1, 4, 16)}
            configs.SCHEDULE_KERNEL_MAX_SLOTS = 0
            slow = Schedule(ids, num_experts)
            slow_tiles = {bm: slow.tiles(bm) for bm in (1, 4, 16)}
        finally:
            configs.SCHEDULE_KERNEL_MAX_SLOTS, configs.SCHEDULE_KERNEL = saved, saved_launch
        assert fast._use_kernel and not slow._use_kernel
        assert (torch.equal(fast.sorted_slots_N, slow.sorted_slots_N)
                and torch.equal(fast.expert_start, slow.expert_start))
        given = Schedule(ids, num_experts, slow.sorted_slots_N.long(), slow.expert_start.long())
        given_tiles = {bm: given.tiles(bm) for bm in (1, 4, 16)}
        for tiles in (fast_tiles, given_tiles):
            for block_m, want in slow_tiles.items():
                got = tiles[block_m]
                assert got[3] == want[3] and all(torch.equal(a, b) for a, b in zip(got[:3], want[:3])), block_m


@case
def schedule_moves_rows_like_torch():
    """Schedule.row_of_slot is the inverse permutation of sorted_slots_N and gather_token_rows x's rows in
    schedule order, element for element (several program blocks, a partial last one)."""
    import torch

    from mok.kernels.moe import configs
    from mok.kernels.moe.schedule import Schedule

    gen = torch.Generator().manual_seed(3)
    saved = configs.MOVE_ROWS
    configs.MOVE_ROWS = dict(index_block=8, row_block=16)
    try:
        for num_tokens, num_experts, top_k, hidden in ((5, 4, 2, 37), (13, 9, 3, 16), (1, 16, 4, 5)):
            ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]).int()
            sched = Schedule(ids, num_experts)
            x = torch.randn(num_tokens, hidden, generator=gen).half()
            want_rows = torch.empty(ids.numel(), dtype=torch.int32)
            want_rows[sched.sorted_slots_N.long()] = torch.arange(ids.numel(), dtype=torch.int32)
            assert torch.equal(sched.row_of_slot(), want_rows)
            want_x = x.index_select(0, sched.sorted_slots_N.long() // top_k)
            assert torch.equal(sched.gather_token_rows(x, top_k), want_x)
    finally:
        configs.MOVE_ROWS = saved


@case
def backward_frees_its_buffers_without_the_garbage_collector():
    """BackwardStages holds no reference cycle: its gradient buffers (d w13, d w2, d gate_up, d hidden per slot)
    are freed when the last reference goes, not whenever the cyclic collector runs (a training step's memory)."""
    import gc
    import weakref

    import torch

    from mok.kernels.moe import layer as kernels

    x, logits, w13, w2 = _inputs(6, 32, 16, 4)
    ids, weights, _ = kernels.route(logits, 2, True)
    saved = kernels.moe_forward(x, w13, w2, ids, weights, True)[1:]

    def run_stages():
        backward = kernels.BackwardStages(torch.ones_like(x), x, w13, w2, ids, weights, *saved)
        for _, run in backward.stages:
            run()
        return weakref.ref(backward)

    gc.disable()
    try:
        assert run_stages()() is None
    finally:
        gc.enable()


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
            {"bwd_act": dict(base["bwd_act"], SORTED_DY=1, TMA=1, BLOCK_K=32, LEAN_EPILOGUE=1)},
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


@case
def lean_epilogue_gives_the_same_bits():
    """LEAN_EPILOGUE (int32 offsets, pointers built after the K loop and, in bwd_act, the SwiGLU backward in two
    column halves of the accumulator) gives the bits of the plain epilogue: every gradient of moe_backward with it
    in bwd_act (d y in slot or schedule order, partial tiles) or in bwd_dx, and the forward with it in GEMM 2."""
    import torch

    from mok.kernels.moe import layer as kernels

    for shape in ((3, 64, 32, 16, 4), (7, 40, 24, 6, 3), (9, 40, 48, 6, 3)):
        _, want, (x, w13, w2, ids, weights) = _forward_pair(shape, seed=21)
        grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(22)).bfloat16()
        for base in (dict(BLOCK_M=16, BLOCK_N=32, GROUP_M=2, num_warps=4, num_stages=2),
                     dict(BLOCK_M=32, BLOCK_N=16, GROUP_M=1, SORTED_DY=1, num_warps=4, num_stages=2),
                     dict(BLOCK_M=16, BLOCK_N=16, GROUP_M=2, BLOCK_K=32, num_warps=4, num_stages=2)):
            plain = kernels.moe_backward(grad_out, x, w13, w2, ids, weights, *want[1:], configs={"bwd_act": base})
            for lean_epilogue in (1, 2):
                lean = kernels.moe_backward(grad_out, x, w13, w2, ids, weights, *want[1:],
                                            configs={"bwd_act": dict(base, LEAN_EPILOGUE=lean_epilogue)})
                for label, a, b in zip(("d hidden", "d w13", "d w2", "d weights"), lean, plain):
                    assert torch.equal(a, b), (shape, base, lean_epilogue, label)
        # the plain epilogues: GEMM 2 (C rows by slot), bwd_dx (fp32 C)
        for base in (dict(BLOCK_M=16, BLOCK_N=32, GROUP_M=2, num_warps=4, num_stages=2),
                     dict(BLOCK_M=32, BLOCK_N=16, GROUP_M=1, BLOCK_K=32, num_warps=4, num_stages=2)):
            forward_plain, _, _ = _forward_pair(shape, {"gemm2": base}, seed=21)
            plain = kernels.moe_backward(grad_out, x, w13, w2, ids, weights, *want[1:], configs={"bwd_dx": base})
            for lean_epilogue in (1, 2):
                lean_cfg = dict(base, LEAN_EPILOGUE=lean_epilogue)
                forward_lean, _, _ = _forward_pair(shape, {"gemm2": lean_cfg}, seed=21)
                for label, a, b in zip(("out", "gate_up", "act", "y"), forward_lean, forward_plain):
                    assert torch.equal(a, b), (shape, base, lean_epilogue, label)
                lean = kernels.moe_backward(grad_out, x, w13, w2, ids, weights, *want[1:],
                                            configs={"bwd_dx": lean_cfg})
                for label, a, b in zip(("d hidden", "d w13", "d w2", "d weights"), lean, plain):
                    assert torch.equal(a, b), (shape, base, lean_epilogue, label)


@case
def combine_backward_gives_the_same_bits_at_any_slots_per_program():
    """The combine's backward with 1, 2, 3 (not dividing K) or K slots per program, d y in slot or schedule order:
    the same d y and d topk_weights, and d y is weight * d out row for row (to the interpreter's bf16 rounding)."""
    import torch

    from mok.kernels.moe import configs
    from mok.kernels.moe.combine import launch_combine_backward

    gen = torch.Generator().manual_seed(31)
    num_tokens, hidden, top_k = 5, 40, 4
    grad_out = torch.randn(num_tokens, hidden, generator=gen).bfloat16()
    y = torch.randn(num_tokens * top_k, hidden, generator=gen).bfloat16()
    weights = torch.rand(num_tokens, top_k, generator=gen)
    row_of_slot = torch.randperm(num_tokens * top_k, generator=gen).to(torch.int32)
    saved = configs.COMBINE_BACKWARD_SLOTS
    try:
        for rows in (None, row_of_slot):
            results = []
            for slots in (0, 1, 2, 3, top_k):
                configs.COMBINE_BACKWARD_SLOTS = slots
                results.append(launch_combine_backward(grad_out, y, weights, top_k, rows))
            for grad_y, grad_weights in results[1:]:
                assert torch.equal(grad_y, results[0][0]) and torch.equal(grad_weights, results[0][1]), slots
            expected = (weights.reshape(-1, 1) * grad_out.float().repeat_interleave(top_k, 0)).bfloat16()
            got = results[0][0] if rows is None else results[0][0][row_of_slot.long()]
            _close(got, expected, f"d y, rows {rows is not None}")
    finally:
        configs.COMBINE_BACKWARD_SLOTS = saved


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


def _spoil(logits, token, how):
    """logits with row `token` made undefined (docs/contracts.md, "Routing")."""
    logits = logits.clone()
    inf = float("inf")
    if how == "nan":
        logits[token, 1] = float("nan")
    elif how == "+inf":
        logits[token, 0] = inf
    else:  # every logit -inf
        logits[token] = -inf
    return logits


@case
def route_kernel_sends_undefined_tokens_to_first_experts_with_nan_weights():
    """NaN / +Inf / all -Inf logits: the kernel gives ids 0..K-1, NaN weights and a NaN probs row, as the
    reference does; the other tokens get the bits they get without the bad token."""
    import torch

    from mok.kernels.moe import layer as kernels
    from mok.reference import moe as reference

    for num_experts, top_k, renorm in ((8, 2, True), (6, 3, False), (123, 8, True)):
        logits = torch.randn(6, num_experts, generator=torch.Generator().manual_seed(num_experts))
        keep = [0, 2, 4, 5]
        clean_ids, clean_weights, clean_probs = kernels.route(logits[keep], top_k, renorm)
        for how in ("nan", "+inf", "-inf"):
            bad = _spoil(_spoil(logits, 1, how), 3, "nan" if how != "nan" else "-inf")
            ids, weights, probs = kernels.route(bad, top_k, renorm)
            ref_ids, ref_weights, _ = reference.route(bad, top_k, renorm)
            assert torch.equal(ids, ref_ids), (how, ids, ref_ids)
            for t in (1, 3):
                assert ids[t].tolist() == list(range(top_k)), (how, ids[t])
                assert bool(weights[t].isnan().all()) and bool(probs[t].isnan().all()), (how, weights[t])
            assert torch.equal(ids[keep], clean_ids) and torch.equal(weights[keep], clean_weights)
            assert torch.equal(probs[keep], clean_probs)
            replay, replay_probs = kernels.replay_weights(bad, ids, renorm)
            assert bool(replay[1].isnan().all()) and bool(replay[3].isnan().all())
            assert torch.equal(replay[keep], clean_weights)


@case
def route_kernel_replay_of_out_of_range_ids_gives_nan_weights():
    import torch

    from mok.kernels.moe import layer as kernels

    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(3))
    ids, weights, _ = kernels.route(logits, 2, True)
    for dtype in (torch.int32, torch.int64):
        for wrong in (-1, 8, 1000, -2 ** 31) + ((2 ** 32, 2 ** 32 + 1) if dtype == torch.int64 else ()):
            given = ids.to(dtype).clone()
            given[2, 1] = wrong
            replay, _ = kernels.replay_weights(logits, given, True)
            assert bool(replay[2].isnan().all()), (dtype, wrong, replay[2])
            keep = [0, 1, 3, 4]
            assert torch.equal(replay[keep], weights[keep])


def _neutral_ids(ids, bad_tokens):
    ids = ids.clone()
    for t in bad_tokens:
        ids[t] = torch_arange_like(ids[t])
    return ids


def torch_arange_like(row):
    import torch

    return torch.arange(row.numel(), dtype=row.dtype)


@case
def moe_forward_row_of_undefined_token_is_nan_others_unchanged():
    """The CUDA forward path (route kernel, schedule kernel or torch schedule, GEMMs, combine) on spoiled
    logits: the bad tokens' rows are NaN; every other row has the bits of the same batch where the bad tokens
    route to experts 0..K-1 with finite weights (the same schedule, hence the same tiles), and matches the
    batch without the bad tokens (the interpreter's numpy tile dot may round by tile: close)."""
    import torch

    from mok.kernels.moe import configs
    from mok.kernels.moe import layer as kernels

    x, logits, w13, w2 = _inputs(9, 40, 24, 6, seed=13)
    top_k, bad_tokens = 2, (2, 7)
    keep = [t for t in range(9) if t not in bad_tokens]
    bad = _spoil(_spoil(logits, 2, "nan"), 7, "+inf")
    clean = kernels.moe_forward(x[keep], w13, w2, *kernels.route(logits[keep], top_k, True)[:2], False)[0]
    saved = configs.SCHEDULE_KERNEL_MAX_SLOTS
    for max_slots in (saved, 0):  # the one-launch schedule kernel, then the torch schedule
        configs.SCHEDULE_KERNEL_MAX_SLOTS = max_slots
        try:
            ids, weights, _ = kernels.route(bad, top_k, True)
            got = kernels.moe_forward(x, w13, w2, ids, weights, True)
            ok_weights = weights.clone()
            ok_weights[list(bad_tokens)] = 0.5
            same_schedule = kernels.moe_forward(x, w13, w2, _neutral_ids(ids, bad_tokens), ok_weights, False)[0]
        finally:
            configs.SCHEDULE_KERNEL_MAX_SLOTS = saved
        out = got[0]
        for t in bad_tokens:
            assert bool(out[t].isnan().all()), (max_slots, t, out[t])
        assert not bool(out[keep].isnan().any())
        assert torch.equal(out[keep], same_schedule[keep]), max_slots
        _close(out[keep], clean, f"without the bad tokens ({max_slots})")
        # the backward runs on the saved schedule without error; the good tokens' d hidden is finite
        grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(14)).bfloat16()
        back = kernels.moe_backward(grad_out, x, w13, w2, ids, weights, *got[1:])
        assert back[0].shape == x.shape


@case
def moe_forward_neutralises_out_of_range_replay_ids():
    """Replayed ids outside [0, E) (not range-checked on CUDA): the token runs on experts 0..K-1 with NaN
    weights, on the device, for int32 and int64 ids (an int64 id must not wrap into range), with the schedule
    kernel and the torch schedule; every other row keeps its bits and nothing collides."""
    import torch

    from mok.kernels.moe import configs
    from mok.kernels.moe import layer as kernels
    from mok.kernels.moe.schedule import Schedule

    x, logits, w13, w2 = _inputs(8, 40, 24, 6, seed=15)
    top_k = 3
    ids, weights, _ = kernels.route(logits, top_k, True)
    wrong = {1: (0, -1), 4: (2, 6), 6: (1, 2 ** 32)}  # token: (k, id)
    bad_tokens = sorted(wrong)
    keep = [t for t in range(8) if t not in wrong]
    saved = configs.SCHEDULE_KERNEL_MAX_SLOTS
    for dtype in (torch.int64, torch.int32):
        given = ids.to(dtype).clone()
        for t, (k, value) in wrong.items():
            if dtype == torch.int32 and value >= 2 ** 31:
                value = 7
            given[t, k] = value
        neutral = _neutral_ids(given, bad_tokens)
        for max_slots in (saved, 0):
            configs.SCHEDULE_KERNEL_MAX_SLOTS = max_slots
            try:
                sched = Schedule(given, 6, block_m=4)
                want = Schedule(neutral, 6, block_m=4)
                assert torch.equal(sched.sorted_slots_N, want.sorted_slots_N), (dtype, max_slots)
                assert torch.equal(sched.expert_start, want.expert_start), (dtype, max_slots)
                assert all(torch.equal(a, b) for a, b in zip(sched.tiles(4)[:3], want.tiles(4)[:3]))
                out = kernels.moe_forward(x, w13, w2, given, weights, False)[0]
                same_schedule = kernels.moe_forward(x, w13, w2, neutral, weights, False)[0]
                # topk_ids alone: the replay weights come from the route kernel (NaN for those tokens)
                replay_weights, _ = kernels.replay_weights(logits, given, True)
                replayed = kernels.moe_forward(x, w13, w2, given, replay_weights, False)[0]
            finally:
                configs.SCHEDULE_KERNEL_MAX_SLOTS = saved
            for t in bad_tokens:
                assert bool(out[t].isnan().all()) and bool(replayed[t].isnan().all()), (dtype, max_slots, t)
            assert torch.equal(out[keep], same_schedule[keep]) and torch.equal(replayed[keep], out[keep])
            assert not bool(out[keep].isnan().any())


@case
def infer_scanning_the_routes_equals_the_schedule():
    """moe_infer's small batches (ScannedRoutes: the GEMMs find their rows in the ids) give the bits of the
    schedule path: same row tiles, rows at the same tile positions (so even numpy's tile-dependent matmul
    agrees). Routed, replayed with a repeated expert in one token, replayed with out-of-range ids (NaN rows),
    experts spanning several row tiles (80 slots on 4 experts), odd K, one token."""
    import torch

    from mok.kernels.moe import configs
    from mok.kernels.moe import layer as kernels
    from mok.kernels.moe.schedule import scans_routes

    def both(*args, **kwargs):
        assert scans_routes(args[4].numel() if args[4] is not None else args[1].shape[0] * args[6])
        scanned = kernels.moe_infer(*args, **kwargs)
        saved = configs.SCAN_MAX_SLOTS
        configs.SCAN_MAX_SLOTS = 0
        try:
            scheduled = kernels.moe_infer(*args, **kwargs)
        finally:
            configs.SCAN_MAX_SLOTS = saved
        assert torch.equal(scanned.view(torch.int16), scheduled.view(torch.int16))
        return scanned

    for shape in [*SHAPES, (40, 32, 16, 4, 2)]:
        num_tokens, hidden, inter, num_experts, top_k = shape
        x, logits, w13, w2 = _inputs(num_tokens, hidden, inter, num_experts, seed=7)
        routed = both(x, logits, w13, w2, None, None, top_k, True)
        ids, weights, _ = kernels.route(logits, top_k, True)
        assert torch.equal(both(x, logits, w13, w2, ids, weights, top_k, True), routed)
        repeated = ids.clone()
        repeated[0, :] = repeated[0, 0]
        both(x, logits, w13, w2, repeated, None, top_k, True)
        wrong = ids.long().clone()
        wrong[-1, 0] = 2 ** 32
        out = both(x, logits, w13, w2, wrong, None, top_k, True)
        assert bool(out[-1].isnan().all()) and torch.equal(out[:-1], routed[:-1]), shape


@case
def infer_routing_inside_gemm1_equals_the_routing_kernel():
    """moe_infer given router logits for a small batch routes inside GEMM 1 (ROUTE_IN_GEMM1_MAX_TOKENS): the output
    bits of the routing kernel's path, and GEMM 1's stored ids and weights equal the routing kernel's; a token with
    a NaN logit gets a NaN row and the others keep their bits; both renormalisations, odd K, one token."""
    import torch

    from mok.kernels.moe import configs
    from mok.kernels.moe import layer as kernels
    from mok.kernels.moe.grouped_gemm import launch_gemm1
    from mok.kernels.moe.schedule import ScannedRoutes

    saved = configs.ROUTE_IN_GEMM1_MAX_TOKENS
    try:
        for shape in [*SHAPES, (2, 32, 16, 40, 8)]:
            num_tokens, hidden, inter, num_experts, top_k = shape
            x, logits, w13, w2 = _inputs(num_tokens, hidden, inter, num_experts, seed=9)
            logits[-1, 0] = float("nan")
            for renormalize in (True, False):
                configs.ROUTE_IN_GEMM1_MAX_TOKENS = 0
                apart = kernels.moe_infer(x, logits, w13, w2, None, None, top_k, renormalize)
                configs.ROUTE_IN_GEMM1_MAX_TOKENS = num_tokens
                inside = kernels.moe_infer(x, logits, w13, w2, None, None, top_k, renormalize)
                assert torch.equal(inside.view(torch.int16), apart.view(torch.int16)), shape
                assert bool(inside[-1].isnan().all()) and not bool(inside[:-1].isnan().any()), shape
                want_ids, want_weights, _ = kernels.route(logits, top_k, renormalize)
                ids = torch.full((num_tokens, top_k), -1, dtype=torch.int32)
                weights = torch.zeros(num_tokens, top_k)
                launch_gemm1(x, w13, ScannedRoutes(ids, num_experts), top_k, False,
                             configs.CONFIGS["decode"]["gemm1"], route=(logits, weights, renormalize))
                assert torch.equal(ids, want_ids), shape
                assert torch.equal(weights.view(torch.int32), want_weights.view(torch.int32)), shape
    finally:
        configs.ROUTE_IN_GEMM1_MAX_TOKENS = saved


# ---------------------------------------------------------------------------------------------
# pytest side


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_logic_under_interpreter(triton_interpret, name):
    assert triton_interpret.verdicts(__file__).get(name) == "ok", triton_interpret.verdicts(__file__).get(
        name, "case did not run")


if __name__ == "__main__":
    sys.exit(run_cases(CASES))
