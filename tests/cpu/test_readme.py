"""The README's and the guide's Python snippets run as printed, each as a script in a fresh directory;
the README's recipe and reward train as printed."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
README = (ROOT / "README.md").read_text()
PAGES = {"README.md": README, "docs/guide.md": (ROOT / "docs" / "guide.md").read_text()}
SNIPPETS = [
    (page, snippet)
    for page, text in PAGES.items()
    for snippet in re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
]


def test_the_pages_have_their_snippets():
    assert sum(page == "README.md" for page, _ in SNIPPETS) >= 2
    assert sum(page == "docs/guide.md" for page, _ in SNIPPETS) >= 2


def test_the_readme_is_a_map():
    """About 150 lines, no issue numbers or progress notes (those live in the closing notes)."""
    assert len(README.splitlines()) <= 150
    assert not re.search(r"#\d+\b|issue", README, flags=re.IGNORECASE)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(SNIPPETS)), ids=[f"{p}-{i}" for i, (p, _) in enumerate(SNIPPETS)])
def test_snippet_runs_as_printed(index, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(SNIPPETS[index][1])
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_the_readme_recipe_and_reward_train_as_printed(tmp_path):
    """`my_recipe.yaml` and `my_reward.py` as the README prints them, trained by its command."""
    (recipe,) = re.findall(r"```yaml\n(.*?)```", README, flags=re.DOTALL)
    reward = next(s for p, s in SNIPPETS if p == "README.md" and "def compute_score" in s)
    (tmp_path / "my_recipe.yaml").write_text(recipe)
    (tmp_path / "my_reward.py").write_text(reward)
    command = next(line for line in README.splitlines() if line.startswith("hybridflow train my_recipe.yaml"))
    args = command.split("#")[0].split()[1:]
    done = subprocess.run(
        [sys.executable, "-m", "hybridflow.cli", *args, "trainer.val_before_train=false", "trainer.save_freq=-1", "--quiet"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 step(s)" in done.stdout, done.stdout[-2000:]
