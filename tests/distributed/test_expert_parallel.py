"""Expert parallelism in mok.moe / mok.MoE: the same bits at every expert-parallel size P.

Each case runs on every rank of a spawned process group (tests/distributed/harness.py): on the CPU with
gloo (P = 2 and 4, in CI), on CUDA with NCCL (P = 1 on one GPU; 2, 4, 8 marked `multigpu`). A case builds
one batch for the group (the ranks' tokens one rank after another, odd counts, one rank sometimes empty),
runs the single-rank layer over all of it on every rank (P = 1), then the expert-parallel layer over the
rank's own tokens and its block of experts, and compares with torch's bitwise equality: outputs,
d hidden, d router logits, d w13 and d w2 (the rank's experts). Loads are uneven on purpose (a skewed
router, replayed ids that leave whole ranks idle), and rows carry rank-distinctive values so that a row
returned to the wrong token or rank shows.
"""
from __future__ import annotations

import functools

import pytest
import torch

from tests.distributed.harness import BACKEND_WORLDS, Cases, Skip, check, run_ranks
from tests.helpers.bits import same_bits

CASES = Cases()
case = CASES.case

# (H, I, experts per rank, K): odd sizes; E = experts per rank * P.
SHAPES = [(40, 24, 3, 3), (33, 17, 2, 2)]


# ---------------------------------------------------------------------------------------------
# helpers (run in the ranks)


def tokens_per_rank(size: int, with_empty: bool) -> list[int]:
    """Odd token counts per rank (1, 3, 5, ...); with_empty: the second rank (or the only one) has none."""
    counts = [2 * r + 1 for r in range(size)]
    if with_empty:
        counts[min(1, size - 1)] = 0
    return counts


def group_inputs(counts, hidden, inter, num_experts, dtype, seed, skew: bool = False, by_rank: bool = False):
    """The group's batch (equal on every rank): x [T, H], logits fp32 [T, E], w13, w2, d out [T, H].

    skew: one expert is favoured by most tokens, the last expert by none (uneven loads, an idle expert).
    by_rank: the rows of rank r are (r + 1) * a row pattern, so every rank's rows differ."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(counts)
    x_TH = torch.randn(total, hidden, generator=gen)
    if by_rank:
        owner_T = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
        x_TH = (owner_T[:, None] + 1).float() * x_TH[:1].expand(total, hidden) * 0.25
    logits_TE = torch.randn(total, num_experts, generator=gen)
    if skew:
        logits_TE[:, num_experts // 2] += 4.0
        logits_TE[:, -1] = -30.0
    w13_E2IH = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2_EHI = torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5
    grad_TH = torch.randn(total, hidden, generator=gen)
    return x_TH.to(dtype), logits_TE, w13_E2IH.to(dtype), w2_EHI.to(dtype), grad_TH.to(dtype)


def run_layer(x_TH, logits_TE, w13_E2IH, w2_EHI, grad_TH, top_k, *, group=None, grad=True, **replay):
    """mok.moe forward (and backward with grad_TH) on fresh leaves -> {name: tensor}."""
    import mok

    leaves = [t.clone().requires_grad_(grad) for t in (x_TH, logits_TE, w13_E2IH, w2_EHI)]
    if "topk_weights" in replay:
        replay = dict(replay, topk_weights=replay["topk_weights"].clone().requires_grad_(grad))
    out_TH = mok.moe(*leaves, top_k, ep_group=group, **replay)
    result = {"out": out_TH.detach()}
    if grad:
        out_TH.backward(grad_TH)
        for name, leaf in zip(("d hidden", "d logits", "d w13", "d w2"), leaves):
            result[name] = leaf.grad
        if "topk_weights" in replay:
            result["d weights"] = replay["topk_weights"].grad
    return result


def compare_with_single_rank(ctx, group, counts, hidden, inter, per_rank, top_k, dtype=torch.bfloat16, seed=0,
                             skew=False, by_rank=False, grad=True, replay=None, edit=None):
    """P = 1 over the group's batch vs P = |group| over this rank's rows and experts: every tensor bitwise.

    replay: a function (logits [T, E]) -> mok.moe replay kwargs over the whole batch; edit: a function that
    changes the batch's logits in place (before replay). Returns (P = 1 results, this rank's results)."""
    import torch.distributed as dist

    import mok.distributed

    size, rank = dist.get_world_size(group), dist.get_rank(group)
    num_experts = per_rank * size
    x, logits, w13, w2, grad_out = group_inputs(counts, hidden, inter, num_experts, dtype, seed, skew, by_rank)
    if edit is not None:
        edit(logits)
    kwargs = replay(logits) if replay is not None else {}
    device = ctx.device
    x, logits, w13, w2, grad_out = (t.to(device) for t in (x, logits, w13, w2, grad_out))
    kwargs = {k: v.to(device) for k, v in kwargs.items()}
    single = run_layer(x, logits, w13, w2, grad_out, top_k, grad=grad, **kwargs)
    start = sum(counts[:rank])
    rows = slice(start, start + counts[rank])
    block = mok.distributed.local_experts(num_experts, group)
    experts = slice(block.start, block.stop)
    mine = run_layer(x[rows], logits[rows], w13[experts], w2[experts], grad_out[rows], top_k, group=group, grad=grad,
                     **{k: v[rows] for k, v in kwargs.items()})
    expected = {"out": single["out"][rows]}
    if grad:
        expected.update({"d hidden": single["d hidden"][rows], "d w13": single["d w13"][experts],
                         "d w2": single["d w2"][experts]})
        if "d weights" in single:  # replayed weights: their gradient instead of the logits'
            expected["d weights"] = single["d weights"][rows]
            assert single["d logits"] is None and mine["d logits"] is None
        else:
            expected["d logits"] = single["d logits"][rows]
    for name, want in expected.items():
        got = mine[name]
        assert got is not None, f"rank {ctx.rank}: {name} is None"
        assert same_bits(got, want), (f"rank {ctx.rank} (P={size}, counts {counts}): {name} differs from P = 1 "
                                      f"(max |diff| {(got.float() - want.float()).abs().max().item()})")
    return single, mine


def groups(ctx):
    """The expert-parallel groups to test at this world size: the whole world, and (world 4) two groups of 2
    side by side (the data-parallel x expert-parallel layout) -> [(group, index of this rank's group)]."""
    import torch.distributed as dist

    out = [(dist.group.WORLD, 0)]
    if ctx.world_size == 4:
        halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        out.append((halves[ctx.rank // 2], ctx.rank // 2))
    return out


# ---------------------------------------------------------------------------------------------
# cases (run on every rank)


@case
def forward_and_every_gradient_equal_single_rank(ctx):
    for group, index in groups(ctx):
        size = torch.distributed.get_world_size(group)
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            for with_empty in (False, True):
                for seed, (hidden, inter, per_rank, top_k) in enumerate(SHAPES):
                    compare_with_single_rank(ctx, group, tokens_per_rank(size, with_empty), hidden, inter, per_rank,
                                             top_k, dtype=dtype, seed=10 * index + seed)


@case
def weight_gradients_reduce_in_the_single_rank_order(ctx):
    """fp32 (every product rounds, so the order of an expert's rows shows in its gradient): P ranks equal
    P = 1 over the ranks' tokens in rank order, and a control shows the test sees order: P = 1 over the same
    tokens with the ranks' blocks in reverse order gives other d w13 bits."""
    size = ctx.world_size
    counts = [9] * size
    single, _ = compare_with_single_rank(ctx, torch.distributed.group.WORLD, counts, 24, 12, 2, 2,
                                         dtype=torch.float32, seed=3)
    if size == 1:
        return
    x, logits, w13, w2, grad_out = group_inputs(counts, 24, 12, 2 * size, torch.float32, 3)
    reverse = torch.arange(sum(counts)).view(size, 9).flip(0).reshape(-1)
    control = run_layer(*(t.to(ctx.device) for t in (x[reverse], logits[reverse], w13, w2, grad_out[reverse])), 2)
    assert same_bits(control["out"], single["out"][reverse.to(ctx.device)])  # rows: batch-invariant
    assert not same_bits(control["d w13"], single["d w13"]), "the row order does not show: the case proves nothing"


@case
def uneven_loads_and_an_idle_expert(ctx):
    size = ctx.world_size
    single, _ = compare_with_single_rank(ctx, torch.distributed.group.WORLD, [7] * size, 40, 24, 3, 2, skew=True,
                                         seed=4)
    assert single["d w13"][-1].abs().sum() == 0  # the idle expert: zero gradient on its rank too (compared)


@case
def replayed_ids_leave_whole_ranks_idle(ctx):
    """Every token on experts 0 and E-1: the first and last rank get every row, the others none."""
    size = ctx.world_size

    def replay(logits):
        num_tokens, num_experts = logits.shape
        ids = torch.tensor([[0, num_experts - 1]], dtype=torch.int32).repeat(num_tokens, 1)  # [0, 2] with no tokens
        return {"topk_ids": ids}

    def replay_both(logits):
        ids = replay(logits)["topk_ids"]
        weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(5))
        return {"topk_ids": ids, "topk_weights": weights}

    for fn in (replay, replay_both):
        compare_with_single_rank(ctx, torch.distributed.group.WORLD, tokens_per_rank(size, True), 33, 17, 2, 2,
                                 replay=fn, seed=6)


@case
def rows_return_to_their_own_rank(ctx):
    """Rank r's rows are (r + 1) * one pattern and all go to the next rank's experts: each rank must get
    back its own rows' outputs (distinct per rank), equal to P = 1's."""
    size = ctx.world_size
    counts = [3] * size
    per_rank = 2

    def to_next_rank(logits):
        for r in range(size):
            target = ((r + 1) % size) * per_rank
            logits[3 * r:3 * (r + 1), target:target + per_rank] += 50.0

    single, mine = compare_with_single_rank(ctx, torch.distributed.group.WORLD, counts, 40, 24, per_rank, 2,
                                            by_rank=True, edit=to_next_rank, seed=7)
    outs = single["out"].float().view(size, 3, -1)
    for r in range(1, size):
        assert not torch.equal(outs[r], outs[0]), "rank-distinctive rows gave equal outputs: the test proves nothing"
    gathered = [torch.empty_like(mine["out"]) for _ in range(size)]
    torch.distributed.all_gather(gathered, mine["out"].contiguous())
    assert same_bits(torch.cat(gathered), single["out"])


@case
def undefined_routing_gives_that_token_nan_and_keeps_the_others(ctx):
    size = ctx.world_size

    def nan_on_last_rank(logits):
        logits[-1, 0] = float("nan")

    single, mine = compare_with_single_rank(ctx, torch.distributed.group.WORLD, tokens_per_rank(size, False), 24,
                                            12, 2, 2, edit=nan_on_last_rank, seed=8, grad=False)
    assert torch.isnan(single["out"][-1]).all() and not torch.isnan(single["out"][:-1]).any()


@case
def inference_mode_equals_training_forward(ctx):
    size = ctx.world_size
    counts = tokens_per_rank(size, False)
    with torch.no_grad():
        _, no_grad = compare_with_single_rank(ctx, torch.distributed.group.WORLD, counts, 40, 24, 3, 3, seed=9,
                                              grad=False)
    _, trained = compare_with_single_rank(ctx, torch.distributed.group.WORLD, counts, 40, 24, 3, 3, seed=9)
    assert same_bits(no_grad["out"], trained["out"])


@case
def module_moe_with_ep_group_equals_single_rank(ctx):
    import mok

    group = torch.distributed.group.WORLD
    size, rank = ctx.world_size, ctx.rank
    hidden, inter, num_experts, top_k = 40, 24, 2 * size, 2
    torch.manual_seed(11)
    full = mok.MoE(hidden, inter, num_experts, top_k).to(ctx.device)
    sharded = mok.MoE(hidden, inter, num_experts, top_k, ep_group=group, device=ctx.device)
    block = sharded.experts
    assert block == range(rank * 2, rank * 2 + 2) and tuple(sharded.w13.shape) == (2, 2 * inter, hidden)
    with torch.no_grad():
        sharded.router_weight.copy_(full.router_weight)
        sharded.w13.copy_(full.w13[block.start:block.stop])
        sharded.w2.copy_(full.w2[block.start:block.stop])
    counts = tokens_per_rank(size, True)
    x = torch.randn(sum(counts), hidden, generator=torch.Generator().manual_seed(12)).bfloat16().to(ctx.device)
    start = sum(counts[:rank])
    rows = slice(start, start + counts[rank])
    x_full = x.clone().requires_grad_()
    full(x_full).float().square().sum().backward()
    x_mine = x[rows].clone().requires_grad_()
    out = sharded(x_mine)
    out.float().square().sum().backward()
    assert same_bits(out, full(x)[rows].detach()) and same_bits(x_mine.grad, x_full.grad[rows])
    assert same_bits(sharded.w13.grad, full.w13.grad[block.start:block.stop])
    assert same_bits(sharded.w2.grad, full.w2.grad[block.start:block.stop])
    assert f"ep_size={size}" in repr(sharded)


@case
def bad_inputs_raise_one_line_errors(ctx):
    import mok

    group = torch.distributed.group.WORLD
    size = ctx.world_size
    if size == 1:
        raise Skip("every E is divisible by 1")
    with pytest.raises(mok.UnsupportedError, match="not divisible by the expert-parallel size"):
        mok.MoE(16, 8, 2 * size + 1, 2, ep_group=group)
    x = torch.randn(3, 16).bfloat16()
    w13, w2 = torch.randn(2, 16, 16).bfloat16(), torch.randn(2, 16, 8).bfloat16()
    with pytest.raises(mok.UnsupportedError, match="router_logits have 2 experts, but w13 holds 2 per rank"):
        mok.moe(x, torch.randn(3, 2), w13, w2, 2, ep_group=group)
    with pytest.raises(mok.UnsupportedError, match="ep_group must be a torch.distributed.ProcessGroup"):
        mok.moe(x, torch.randn(3, 2 * size), w13, w2, 2, ep_group="world")
    torch.distributed.barrier()


# ---------------------------------------------------------------------------------------------
# tests (the parent)


@functools.cache
def _verdicts(world_size: int, backend: str):
    return run_ranks(__name__, world_size, backend, timeout=600)


@pytest.mark.parametrize("backend, world_size", BACKEND_WORLDS)
@pytest.mark.parametrize("name", list(CASES))
def test_expert_parallel_case(backend, world_size, name):
    check(_verdicts(world_size, backend), name)
