"""README.md's Python examples run as written (on the suite's 8 CPU devices)."""

import os
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def _examples() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    # A multi-process example needs a cluster (jaxpar.init finds its processes there).
    return [b for b in blocks if "jaxpar.init(" not in b]


def test_the_readme_has_examples_to_run():
    assert len(_examples()) >= 2


@pytest.mark.parametrize("n", range(len(_examples())))
def test_a_readme_example_runs_as_written(n, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the examples write plan.json and strategy.json here
    exec(compile(_examples()[n], f"README.md example {n + 1}", "exec"), {})
    assert os.listdir(tmp_path), "each example saves a plan or a strategy file"
