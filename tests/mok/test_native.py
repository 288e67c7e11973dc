"""The native eager path's Python side on any machine (mok/kernels/native): the call back that records a site's
launches, and the fallback when the extension cannot be built. Its C++ side runs on the GPU only
(tests/mok/test_dense_gpu.py: the plan tests on both paths, capture, double backward, settings, aliasing)."""

import warnings

import pytest
import torch

from mok.kernels import launch, native


@pytest.fixture
def site(monkeypatch):
    """A stand-in site (number 99) that records one launch of a kernel reading per_call[0] when asked to."""
    calls = []
    found = launch._Compiled(run=None, function=5, packed_metadata=(4, 1, 0), direct=print, cooperative=False,
                             pdl=False, signature=("*fp32", "fp32"))

    def launches(per_call, scalars):
        calls.append((per_call, scalars))
        recording = getattr(launch._recordings, "active", None)
        if recording is not None:
            recording.add(found, (1, 1, 1), (per_call[0], scalars[0]))

    monkeypatch.setitem(native.sites, 99, launches)
    return calls


def test_the_call_back_records_exports_or_only_runs(site, monkeypatch):
    """_run_site: with record, the site's launches run inside a recording and come back exported, to be kept for
    the key; without record they only run; where plans are not allowed now (a profiler's launch hooks), they run
    unrecorded and the answer is not to be kept."""
    x = torch.zeros(4)
    exported, keep, kept = native._run_site(99, [x], [0.5], True)
    assert keep and not kept
    assert exported == [(5, (1, 1, 1), 128, 0, False, False, [(0, 0), (0x3F000000, -1), (0, -1), (0, -1)])]
    assert native._run_site(99, [x], [0.5], False) == (None, False, [])
    monkeypatch.setattr(launch, "replays_allowed", lambda: False)
    assert native._run_site(99, [x], [0.5], True) == (None, False, [])
    assert len(site) == 3 and site[0] == ((x,), (0.5,))


def test_a_site_that_keeps_a_workspace_hands_it_over_with_its_plan(monkeypatch):
    """A site returning the tensors its launches keep reading (the MoE decode's workspace): their addresses stay in the
    exported plan as recorded, and the tensors come back with it, for native.cpp to hold while the plan lives."""
    found = launch._Compiled(run=None, function=5, packed_metadata=(4, 1, 0), direct=print, cooperative=False,
                             pdl=False, signature=("*fp32", "*fp32"))
    workspace = torch.zeros(16)

    def launches(per_call, scalars):
        launch._recordings.active.add(found, (1, 1, 1), (per_call[0], workspace[4:]))
        return (workspace,)

    monkeypatch.setitem(native.sites, 97, launches)
    exported, keep, kept = native._run_site(97, [torch.zeros(4)], [], True)
    assert keep and kept == [workspace]
    assert exported[0][6][:2] == [(0, 0), (workspace.data_ptr() + 16, -1)]


def test_a_recording_that_cannot_be_replayed_is_kept_as_no_plan(site, monkeypatch):
    """A site whose launch reads a tensor that is not one of the call's (a temporary) gives no plan: None, kept,
    so that the key runs the Python launcher without recording again."""
    temporary = torch.zeros(2)
    monkeypatch.setitem(native.sites, 98, lambda per_call, scalars: native.sites[99]((temporary,), scalars))
    assert native._run_site(98, [torch.zeros(4)], [1.0], True) == (None, True, [])


def test_without_a_build_mok_warns_once_and_keeps_the_python_path(monkeypatch):
    """When torch cannot build the extension (no compiler, no CUDA headers), load() warns once and returns None, and
    function() gives None from then on (EagerOp then runs the Python path); MOK_NATIVE=0 and ENABLED = False give None
    too."""
    from torch.utils import cpp_extension

    def no_compiler(**kwargs):
        raise OSError("CUDA_HOME environment variable is not set.")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_failed", False)
    with pytest.warns(UserWarning, match="native eager path could not be built"):
        assert native.load() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.load() is None and native.function("rms_norm") is None
    monkeypatch.setattr(native, "_failed", False)
    monkeypatch.setattr(native, "_disabled_by_environment", True)  # MOK_NATIVE=0
    assert native.function("rms_norm") is None
    monkeypatch.setattr(native, "_disabled_by_environment", False)
    monkeypatch.setattr(native, "ENABLED", False)
    assert native.function("rms_norm") is None
    assert native.stats() == (0, 0, 0, 0)


def test_site_numbers_agree_with_plans_h():
    """The Python names of the sites and plans.h's constants are one list."""
    import re
    from pathlib import Path

    from mok.kernels import native

    source = Path(native.__file__).with_name("plans.h").read_text()
    cpp = {re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper(): int(number)
           for name, number in re.findall(r"constexpr int64_t k(\w+)Site = (\d+);", source)}
    python = {name.removesuffix("_SITE"): getattr(native, name) for name in dir(native) if name.endswith("_SITE")}
    assert cpp == python and set(native.sites) == set(python.values())
