"""`multigpu(n)`: a test that needs n CUDA GPUs of one host; skipped where fewer are present."""
from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        marker = item.get_closest_marker("multigpu")
        if marker is None:
            continue
        needed = int(marker.args[0]) if marker.args else 2
        if n_gpus < needed:
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA GPUs, {n_gpus} present"))
