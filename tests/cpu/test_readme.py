"""The README's Python snippets run as printed, each as a script in a fresh directory."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parents[2] / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_the_readme_has_its_snippets():
    assert len(SNIPPETS) >= 3


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_snippet_runs_as_printed(index, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(SNIPPETS[index])
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
