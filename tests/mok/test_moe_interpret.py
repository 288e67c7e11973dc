"""Logic of the MoE Triton kernels (mok/kernels/moe/) under TRITON_INTERPRET=1 on CPU tensors.

The cases run in one child process (this file run as a script, through the `triton_interpret` fixture of
tests/conftest.py) and pytest checks each case's verdict. Tiny shapes. Expected values come from the CPU
reference path (mok/reference/moe.py); GEMM accumulation orders differ (numpy inside the interpreter),
hence bf16-ulp tolerances, while routing, the schedule and every piece of index logic must match exactly.
Here: routing, the schedule, forward and backward against the reference, batch invariance; kernel variants that
must agree: test_moe_interpret_paths.py; undefined routing: test_moe_interpret_undefined.py; shared inputs:
tests/helpers/moe_interpret.py.
"""
from __future__ import annotations

import sys

from tests.helpers.interpret import Cases, interpreter_test, run_cases
from tests.helpers.moe_interpret import SHAPES, assert_close_scaled, forward_pair, moe_inputs

CASES = Cases()
case = CASES.case


# ---------------------------------------------------------------------------------------------
# cases (run in the child)


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
        assert_close_scaled(probs, ref_probs, "probs", 1e-5)
        assert_close_scaled(weights, ref_weights, "weights", 1e-5)
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

    x, logits, w13, w2 = moe_inputs(6, 32, 16, 4)
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
def forward_matches_reference():
    import torch

    for shape in SHAPES:
        got, want, _ = forward_pair(shape)
        for label, a, b in zip(("out", "gate_up", "act", "y"), got[:4], want[:4]):
            assert_close_scaled(a, b, f"{shape} {label}")
        assert torch.equal(got[4], want[4]) and torch.equal(got[5], want[5])


@case
def forward_without_saving_gives_the_same_output():
    import torch

    from mok.kernels.moe import layer as kernels

    got, _, (x, w13, w2, ids, weights) = forward_pair(SHAPES[1])
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
        got, want, _ = forward_pair(SHAPES[1], configs, seed=2)
        for label, a, b in zip(("out", "gate_up", "act", "y"), got[:4], want[:4]):
            assert_close_scaled(a, b, label)


@case
def backward_matches_reference():
    import torch

    from mok.kernels.moe import layer as kernels
    from mok.kernels.moe.configs import CONFIGS
    from mok.reference import moe as reference

    for shape in SHAPES:
        for configs in (None, dict(CONFIGS["small"])):
            _, want, (x, w13, w2, ids, weights) = forward_pair(shape, seed=3)
            grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(4)).bfloat16()
            # feed both the reference's saved tensors: differences are then summation order only
            got = kernels.moe_backward(grad_out, x, w13, w2, ids, weights, *want[1:], configs=configs)
            expected = reference.moe_backward(grad_out, x, w13, w2, ids, weights, *want[1:])
            for label, a, b in zip(("d hidden", "d w13", "d w2", "d weights"), got, expected):
                assert_close_scaled(a, b, f"{shape} {label}")
            unused = [e for e in range(w13.shape[0]) if not bool((ids == e).any())]
            assert all(bool((got[1][e] == 0).all()) and bool((got[2][e] == 0).all()) for e in unused)


@case
def forward_rows_are_batch_invariant_in_the_kernel_logic():
    """A token alone and inside a permuted batch: same experts, same rows up to the interpreter's
    per-tile numpy dot (close), and the combine/index logic never mixes rows."""
    import torch

    from mok.kernels.moe import layer as kernels
    from mok.reference import moe as reference

    x, logits, w13, w2 = moe_inputs(12, 40, 24, 4, seed=5)
    ids, weights, _ = kernels.route(logits, 2, True)
    full = kernels.moe_forward(x, w13, w2, ids, weights, False)[0]
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(6))
    permuted = kernels.moe_forward(x[perm], w13, w2, ids[perm], weights[perm], False)[0]
    assert_close_scaled(permuted, full[perm], "permuted")
    for t in (0, 11):
        alone = kernels.moe_forward(x[t:t + 1], w13, w2, ids[t:t + 1], weights[t:t + 1], False)[0]
        assert_close_scaled(alone[0], full[t], f"alone {t}")
    ref_ids, _, _ = reference.route(logits, 2, True)
    assert torch.equal(ids, ref_ids)


# ---------------------------------------------------------------------------------------------
# pytest side


test_kernel_logic_under_interpreter = interpreter_test(CASES, __file__)


if __name__ == "__main__":
    sys.exit(run_cases(CASES))
