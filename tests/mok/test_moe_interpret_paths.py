"""MoE Triton kernel variants under TRITON_INTERPRET=1 on CPU tensors (the harness: test_moe_interpret.py): TMA
descriptors, backward layouts and weight-grad TMA, the lean epilogue, the combine backward's slots per program,
small batches scanning their routes instead of a schedule, routing inside GEMM 1. Each gives the reference's rows
(bf16-ulp tolerances) or the bits of the plain path.
"""
from __future__ import annotations

import sys

from tests.helpers.interpret import Cases, interpreter_test, run_cases
from tests.helpers.moe_interpret import SHAPES, assert_close_scaled, descriptor_spy, forward_pair, moe_inputs

CASES = Cases()
case = CASES.case


# ---------------------------------------------------------------------------------------------
# cases (run in the child)


@case
def tma_descriptors_take_every_path_and_match():
    """TMA on (bf16, aligned shapes): every descriptor path (weights [N, K] and [K, N], contiguous A
    rows) runs and gives the reference's rows and gradients; misaligned shapes fall back to pointers."""
    import torch

    from mok.kernels.moe import layer as kernels
    from mok.kernels.moe.configs import CONFIGS
    from mok.reference import moe as reference

    with descriptor_spy() as used:
        for shape, block_k in (((40, 64, 32, 8, 2), 32), (SHAPES[0], 64), (SHAPES[2], 32)):
            used.clear()
            configs = {name: dict(cfg, TMA=1, BLOCK_K=block_k) for name, cfg in CONFIGS["small"].items()}
            configs["gemm1"]["BLOCK_N"] = 16
            got, want, (x, w13, w2, ids, weights) = forward_pair(shape, configs, seed=8)
            for label, a, b in zip(("out", "gate_up", "act", "y"), got[:4], want[:4]):
                assert_close_scaled(a, b, f"{shape} {label}")
            grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(9)).bfloat16()
            back = kernels.moe_backward(grad_out, x, w13, w2, ids, weights, *want[1:], configs=configs)
            expected = reference.moe_backward(grad_out, x, w13, w2, ids, weights, *want[1:])
            for label, a, b in zip(("d hidden", "d w13", "d w2", "d weights"), back, expected):
                assert_close_scaled(a, b, f"{shape} {label}")
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

    with descriptor_spy() as used:
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
            _, want, (x, w13, w2, ids, weights) = forward_pair(shape, seed=11)
            grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(12)).bfloat16()
            got = kernels.moe_backward(grad_out, x, w13, w2, ids, weights, *want[1:], configs=override)
            expected = reference.moe_backward(grad_out, x, w13, w2, ids, weights, *want[1:])
            for label, a, b in zip(("d hidden", "d w13", "d w2", "d weights"), got, expected):
                assert_close_scaled(a, b, f"{override} {label}")
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
        _, want, (x, w13, w2, ids, weights) = forward_pair(shape, seed=21)
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
            forward_plain, _, _ = forward_pair(shape, {"gemm2": base}, seed=21)
            plain = kernels.moe_backward(grad_out, x, w13, w2, ids, weights, *want[1:], configs={"bwd_dx": base})
            for lean_epilogue in (1, 2):
                lean_cfg = dict(base, LEAN_EPILOGUE=lean_epilogue)
                forward_lean, _, _ = forward_pair(shape, {"gemm2": lean_cfg}, seed=21)
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
            assert_close_scaled(got, expected, f"d y, rows {rows is not None}")
    finally:
        configs.COMBINE_BACKWARD_SLOTS = saved


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
        x, logits, w13, w2 = moe_inputs(num_tokens, hidden, inter, num_experts, seed=7)
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
            x, logits, w13, w2 = moe_inputs(num_tokens, hidden, inter, num_experts, seed=9)
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


test_kernel_logic_under_interpreter = interpreter_test(CASES, __file__)


if __name__ == "__main__":
    sys.exit(run_cases(CASES))
