"""The README's Python examples run as written (the ones that need neither vLLM nor a GPU)."""
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
RUNNABLE = [b for b in BLOCKS if "from_pretrained(path" not in b]


def test_readme_has_runnable_examples():
    assert len(RUNNABLE) >= 3


@pytest.mark.parametrize("index", range(len(RUNNABLE)))
def test_readme_example_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(RUNNABLE[index], f"README.md[python block {index}]", "exec"), {"__name__": "readme"})
