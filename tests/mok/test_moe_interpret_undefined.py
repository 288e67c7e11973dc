"""Undefined routing under TRITON_INTERPRET=1 on CPU tensors (the harness: test_moe_interpret.py; the contract:
docs/contracts.md, "Routing"): NaN / +Inf / all -Inf logits and out-of-range replay ids give NaN rows for those
tokens, and every other row keeps its bits.
"""
from __future__ import annotations

import sys

from tests.helpers.interpret import Cases, interpreter_test, run_cases
from tests.helpers.moe_interpret import assert_close_scaled, moe_inputs

CASES = Cases()
case = CASES.case


# ---------------------------------------------------------------------------------------------
# cases (run in the child)


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

    x, logits, w13, w2 = moe_inputs(9, 40, 24, 6, seed=13)
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
        assert_close_scaled(out[keep], clean, f"without the bad tokens ({max_slots})")
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

    x, logits, w13, w2 = moe_inputs(8, 40, 24, 6, seed=15)
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


# ---------------------------------------------------------------------------------------------
# pytest side


test_kernel_logic_under_interpreter = interpreter_test(CASES, __file__)


if __name__ == "__main__":
    sys.exit(run_cases(CASES))
