"""rl.wrap under FSDP2 with expert parallelism (rl.distributed): per-rank log-probabilities equal one
process's bitwise, experts' gradients too (one replica), and three AdamW steps are reproducible.

Cases run on every rank of spawned process groups (tests/distributed/harness.py): gloo on the CPU with
2 and 4 processes (4: two data-parallel replicas x 2 expert ranks, and 4 expert ranks), NCCL on GPUs
(1 on one GPU; 2-8 marked `multigpu`). The one-process reference runs in every rank on a copy of the
same model, over the batch of all ranks (rank r owns rows [r * B, (r + 1) * B)).
"""
from __future__ import annotations

import copy
import functools
import hashlib
import json

import pytest
import torch

from tests.distributed.harness import BACKEND_WORLDS, Cases, Skip, check, run_ranks
from tests.helpers.bits import same_bits

CASES = Cases()
case = CASES.case
ROWS_PER_RANK = 3


def global_batch(world_size: int, seed: int, length: int = 7):
    """input_ids [W * B, L] and attention_mask with odd real lengths, left and right padding."""
    gen = torch.Generator().manual_seed(seed)
    rows = world_size * ROWS_PER_RANK
    input_ids = torch.randint(3, 500, (rows, length), generator=gen)
    mask = torch.zeros(rows, length, dtype=torch.int64)
    for row in range(rows):
        real = 2 + (row * 3 + seed) % (length - 1)
        start = 0 if row % 2 else length - real
        mask[row, start:start + real] = 1
    return input_ids, mask


def rank_rows(ctx) -> slice:
    return slice(ctx.rank * ROWS_PER_RANK, (ctx.rank + 1) * ROWS_PER_RANK)


def tiny(ctx, **overrides):
    from rl.testing import tiny_config, tiny_model

    if overrides:
        import transformers

        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", **overrides),
                                                              dtype=torch.bfloat16)
    else:
        model = tiny_model("qwen3_moe", seed=0)
    return model.to(ctx.device)


def ep_sizes(ctx) -> list[int]:
    return [size for size in (1, 2, 4) if size <= ctx.world_size and ctx.world_size % size == 0]


def state_digest(state: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(name.encode() + str(tuple(tensor.shape)).encode() + str(tensor.dtype).encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# cases (run on every rank)


@case
def logprobs_forward_and_expert_gradients_equal_one_process(ctx):
    import rl
    import rl.distributed

    world = ctx.world_size
    input_ids, mask = global_batch(world, seed=1)
    input_ids, mask = input_ids.to(ctx.device), mask.to(ctx.device)
    rows = rank_rows(ctx)
    for ep_size in ep_sizes(ctx):
        model = tiny(ctx)
        single = rl.wrap(copy.deepcopy(model))
        want = rl.logprobs(single, input_ids, mask)
        want.sum().backward()
        want_logits = single(input_ids[rows], mask[rows]).logits.detach()
        rl.distributed.shard(model, ep_size=ep_size)
        assert same_bits(rl.distributed.full_state_dict(model)["lm_head.weight"], single.lm_head.weight.detach())
        got = rl.logprobs(model, input_ids[rows], mask[rows])
        assert same_bits(got.detach(), want[rows].detach()), f"ep_size={ep_size}: logprobs differ from one process"
        assert same_bits(model(input_ids[rows], mask[rows]).logits.detach(), want_logits), f"ep_size={ep_size}: logits"
        got.sum().backward()
        if ep_size == world > 1:  # one replica: each expert rank's gradient = one process's / W, bitwise
            experts = model.model.layers[0].mlp.experts
            block = slice(ctx.rank * 8 // world, (ctx.rank + 1) * 8 // world)
            want_grad = single.model.layers[0].mlp.experts.gate_up_proj.grad[block] / world
            assert experts.gate_up_proj.shape[0] == 8 // world
            assert same_bits(experts.gate_up_proj.grad, want_grad), f"ep_size={ep_size}: expert gradient"
        # every parameter got a gradient; FSDP2's are sharded DTensors, the experts' local tensors
        assert all(p.grad is not None for p in model.parameters())


@case
def full_state_dict_round_trips(ctx):
    import rl.distributed

    for ep_size in ep_sizes(ctx):
        model = tiny(ctx)
        want = {name: t.detach().clone() for name, t in model.state_dict().items()}
        rl.distributed.shard(model, ep_size=ep_size)
        got = rl.distributed.full_state_dict(model)
        assert sorted(got) == sorted(want)
        for name in want:
            assert same_bits(got[name].to(want[name].device), want[name]), f"ep_size={ep_size}: {name}"


@case
def three_adamw_steps(ctx):
    """Three steps on every rank's own batches; the digest of the full weights goes to the parent, which
    compares two separate runs (same world size). Every rank must hold the same full weights."""
    import rl
    import rl.distributed

    ep_size = min(2, ctx.world_size)  # world 4: two replicas x 2 expert ranks
    model = tiny(ctx)
    before = state_digest(model.state_dict())
    rl.distributed.shard(model, ep_size=ep_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rows = rank_rows(ctx)
    for step in range(3):
        input_ids, mask = global_batch(ctx.world_size, seed=10 + step)
        logprobs = rl.logprobs(model, input_ids[rows].to(ctx.device), mask[rows].to(ctx.device))
        loss = -logprobs.sum() / mask[rows, 1:].sum().clamp(min=1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    digest = state_digest(rl.distributed.full_state_dict(model))
    assert digest != before, "the weights did not change"
    everyone = [None] * ctx.world_size
    torch.distributed.all_gather_object(everyone, digest)
    assert len(set(everyone)) == 1, f"ranks hold different full weights: {everyone}"
    if ctx.rank == 0:
        (ctx.out_dir / "digest.json").write_text(json.dumps({"digest": digest}))


@case
def bad_layouts_raise_one_line_errors(ctx):
    import rl
    import rl.distributed

    world = ctx.world_size
    if world == 1:
        raise Skip("every layout divides one rank")
    with pytest.raises(rl.UnsupportedModelError, match="ep_size must be an int >= 1 dividing the world size"):
        rl.distributed.shard(tiny(ctx), ep_size=world + 1)
    odd = tiny(ctx, num_experts=2 * world + 1)
    with pytest.raises(rl.UnsupportedModelError, match=f"{2 * world + 1} experts per layer are not divisible"):
        rl.distributed.shard(odd, ep_size=world)
    torch.distributed.barrier()


# ---------------------------------------------------------------------------------------------
# tests (the parent)


@functools.cache
def _run(world_size: int, backend: str, rerun: bool = False):
    """Every case, or (rerun) the training alone in fresh processes; -> (verdicts, digest of the trained weights)."""
    import tempfile
    from pathlib import Path

    out = Path(tempfile.mkdtemp(prefix="mok-fsdp-"))
    args = {"only": ["three_adamw_steps"]} if rerun else {}
    verdicts = run_ranks(__name__, world_size, backend, timeout=600, args=args, out_dir=out)
    digest = out / "digest.json"
    return verdicts, json.loads(digest.read_text())["digest"] if digest.exists() else None


@pytest.mark.parametrize("backend, world_size", BACKEND_WORLDS)
@pytest.mark.parametrize("name", list(CASES))
def test_fsdp_case(backend, world_size, name):
    check(_run(world_size, backend)[0], name)


@pytest.mark.parametrize("backend, world_size", BACKEND_WORLDS)
def test_rerun_gives_identical_weights(backend, world_size):
    verdicts, first = _run(world_size, backend)
    check(verdicts, "three_adamw_steps")
    again, second = _run(world_size, backend, rerun=True)
    check(again, "three_adamw_steps")
    assert first is not None and first == second
