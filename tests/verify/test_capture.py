"""Recording through a DeviceTap (verify/capture.py): the same records as eager `Recorder.record`, under
torch.compile(fullgraph=True) with changing shapes too, with the rate setting, and a lost step refused by readers.
The Triton append kernel runs under the interpreter against the CPU append (one child process, see
tests/helpers/interpret.py); CUDA graphs: tests/verify/test_capture_gpu.py."""
from __future__ import annotations

import sys

import pytest
import torch

from tests.helpers.interpret import Cases, interpreter_test, run_cases

CASES = Cases()


def _tensors():
    gen = torch.Generator().manual_seed(0)
    return [("a", torch.randn(5, 123, generator=gen).to(torch.bfloat16), "input"),
            ("a", torch.randn(5, 123, generator=gen), "output"),
            ("b", torch.randn(3, 4, 7, generator=gen).half(), "output"),
            ("c", torch.randint(0, 9, (11,), generator=gen), "input"),
            ("d", torch.tensor(2.5), "output"),
            ("e", torch.zeros(0, 6), "output"),
            ("f", torch.randn(2, 1, 3, 1, 2, 5, generator=gen), "grad")]


def _records(path):
    from verify.store import Trace

    with Trace(path) as trace:
        return trace.steps(), [(r.step, r.seq, r.phase, r.name, r.kind, r.dtype, tuple(r.shape), r.digest, r.rows)
                               for r in trace.records()]


def test_tap_records_what_eager_record_records(tmp_path):
    from verify import Recorder

    with Recorder(tmp_path / "eager.db") as eager, Recorder(tmp_path / "tap.db") as tapped:
        tap = tapped.capture("cpu")
        for step in range(2):
            for name, tensor, kind in _tensors():
                eager.record(name, tensor + step if tensor.is_floating_point() else tensor, kind=kind)
                tap(name, tensor + step if tensor.is_floating_point() else tensor, kind)
            eager.step(param_grads=False)
            tapped.step(param_grads=False)
    assert _records(tmp_path / "eager.db") == _records(tmp_path / "tap.db")


def test_compiled_fullgraph_records_every_call_with_its_shape(tmp_path):
    from verify import Recorder

    def layer(x_TF, weight_F, tap):
        tap("scale", x_TF, "input")
        y_TF = x_TF * weight_F + 0.5  # element-wise: Inductor's code gives eager's bits
        tap("scale", y_TF, "output")
        return y_TF.relu()

    weight_F = torch.randn(64)
    inputs = [torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens)) for tokens in (3, 17, 40, 5)]
    with Recorder(tmp_path / "eager.db") as eager_rec, Recorder(tmp_path / "compiled.db") as compiled_rec:
        eager_tap, compiled_tap = eager_rec.capture("cpu"), compiled_rec.capture("cpu")
        compiled = torch.compile(layer, fullgraph=True, dynamic=True)
        for x_TF in inputs:
            assert torch.equal(layer(x_TF, weight_F, eager_tap), compiled(x_TF, weight_F, compiled_tap))
            eager_rec.step(param_grads=False)
            compiled_rec.step(param_grads=False)
    steps, records = _records(tmp_path / "compiled.db")
    assert [n for _, n, _ in steps] == [2, 2, 2, 2]
    assert [r[6] for r in records if r[4] == "input"] == [(3, 64), (17, 64), (40, 64), (5, 64)]
    assert records == _records(tmp_path / "eager.db")[1]


def test_rate_every_skips_steps_and_the_tap_returns_at_once(tmp_path):
    from verify import Recorder

    x = torch.randn(4, 8)
    with Recorder(tmp_path / "rate.db", every=3) as rec:
        tap = rec.capture("cpu")
        for _ in range(7):
            tap("x", x, "output")
            assert tap.holds_entries() == (rec.current_step % 3 == 0)
            rec.step(param_grads=False)
    steps, records = _records(tmp_path / "rate.db")
    assert [s for s, _, _ in steps] == [0, 3, 6]


def test_a_skipped_step_drops_what_a_graph_replay_wrote_without_reading_it(tmp_path):
    """A CUDA graph's replay hashes on steps the rate skips; such a step's commit drops the ring unread (reading
    it would synchronise with the device every step): here an unreadable entry stands for it."""
    from verify import Recorder

    x = torch.randn(4, 8)
    with Recorder(tmp_path / "skip.db", every=2) as rec:
        tap = rec.capture("cpu")
        tap("x", x, "output")
        rec.step(param_grads=False)
        tap.ring[:2] = torch.tensor([1 << 40, 99])  # not an entry harvest() could parse
        tap.state[:2] = torch.tensor([2, 2])
        rec.step(param_grads=False)  # step 1, skipped
        assert not tap.holds_entries()
        tap("x", x, "output")
        rec.step(param_grads=False)
    steps, records = _records(tmp_path / "skip.db")
    assert [s for s, _, _ in steps] == [0, 2] and records[0][2:] == records[1][2:]


def test_an_overflowed_step_is_refused_by_readers_in_one_line(tmp_path):
    from verify import Recorder
    from verify.errors import TraceError
    from verify.store import Trace

    with Recorder(tmp_path / "small.db") as rec:
        tap = rec.capture("cpu", capacity=40)
        tap("fits", torch.randn(3, 5), "output")
        rec.step(param_grads=False)
        for name in ("a", "b", "c"):  # 2 + 2 + 10 entries each: the third does not fit
            tap(name, torch.randn(10, 5), "output")
        rec.step(param_grads=False)
    with pytest.raises(TraceError, match=r"step 1 lost records") as error:
        Trace(tmp_path / "small.db")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("capacity", [0, 15, 2.0, True, "64"])
def test_bad_capacity_is_a_recorder_error(tmp_path, capacity):
    from verify import Recorder
    from verify.errors import RecorderError

    with Recorder(tmp_path / "bad.db") as rec, pytest.raises(RecorderError, match="capacity"):
        rec.capture("cpu", capacity=capacity)


# ---------------------------------------------------------------------------------------------
# the Triton append kernel, under the interpreter


@CASES.case
def ring_append_writes_what_the_cpu_append_writes():
    import torch

    from verify.capture import _append_cpu
    from verify.fingerprints import row_bits, row_fingerprints
    from verify.fingerprints_triton import append_row_digests

    gen = torch.Generator().manual_seed(0)
    # 4 rows of packed bf16; one row of fp32 words; a gated entry; no rows; rows of no bytes; 3,000 strided rows.
    # Unchunked, the small entries take the one-launch kernel (_append_one_program_kernel), the 3,000 rows do not.
    tensors = [torch.randn(4, 5, generator=gen).bfloat16(), torch.randn(1, 7, generator=gen),
               torch.randn(2, 3, generator=gen), torch.zeros(0, 3), torch.zeros(3, 0).bfloat16(),
               torch.randn(3000, 4, generator=gen)[:, ::2]]
    for capacity in (64, 3100, 4000):
        for chunked in (False, True):  # one pass; partial sums of one word per chunk, then a finalize
            kernel_ring, kernel_state = torch.full((capacity,), -1), torch.tensor([0, 0, 1, -1])
            cpu_ring, cpu_state = torch.full((capacity,), -1), torch.tensor([0, 0, 1])
            for i, x in enumerate(tensors):
                gate = int(i != 2)  # the third entry comes on a step the rate skips: nothing appended
                kernel_state[2] = cpu_state[2] = gate
                header = [i, x.dim(), *x.shape]
                bits_RN, key = row_bits(x)
                n_words = (bits_RN.shape[1] * bits_RN.element_size() + 7) // 8
                plan = {"block_r": 4, "block_w": 1, "n_chunks": max(2, n_words), "words_per_chunk": 1}
                append_row_digests(kernel_ring, kernel_state, header, bits_RN, key,
                                   plan_override=plan if chunked else None)
                _append_cpu(cpu_ring, cpu_state, header, row_fingerprints(x).view(torch.int64))
                assert torch.equal(kernel_state[:3], cpu_state), (capacity, chunked, i, kernel_state, cpu_state)
            assert torch.equal(kernel_ring, cpu_ring), (capacity, chunked)
    assert kernel_state[0] == 8 + 5 + 4 + 7 + 3004  # header + rows per entry; the gated entry moved no cursor


test_append_kernel_under_interpreter = interpreter_test(CASES, __file__)


if __name__ == "__main__":
    sys.exit(run_cases(CASES))
