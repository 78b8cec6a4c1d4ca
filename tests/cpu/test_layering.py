"""The package's layers, read from its imports (every `import`, at the top or inside a function): the
rooms below the driver never reach up into it, and the planning files form no circle."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[2] / "hybridflow"


def imports_of(path: Path) -> set[str]:
    """The hybridflow modules a file imports (dotted names)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("hybridflow")}


def module_of(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


@pytest.mark.parametrize("room", ["roles", "algorithms", "models", "engine", "parallel", "rewards", "batch"])
def test_a_room_below_the_driver_never_imports_the_controller_or_the_api(room):
    files = (
        [PACKAGE / f"{room}.py"]
        if (PACKAGE / f"{room}.py").is_file()
        else sorted((PACKAGE / room).rglob("*.py"))
    )
    upward = {
        module_of(f): sorted(
            m for m in imports_of(f) if m.startswith(("hybridflow.controller", "hybridflow.api"))
        )
        for f in files
    }
    assert {m: up for m, up in upward.items() if up} == {}


def test_the_planning_files_form_no_import_circle():
    """The memory plan and the layout choice are computed before the workers start; the worker's model
    builder reads what they decided and never imports them back."""
    planning = [
        PACKAGE / "plan" / "memory.py",
        PACKAGE / "plan" / "layout.py",
        PACKAGE / "controller" / "worker_models.py",
        PACKAGE / "controller" / "role_models.py",
    ]
    names = {module_of(f) for f in planning}
    edges = {module_of(f): imports_of(f) & names for f in planning}

    def reaches(start: str, target: str, seen: frozenset = frozenset()) -> bool:
        return any(n == target or (n not in seen and reaches(n, target, seen | {n})) for n in edges[start])

    assert [m for m in names if reaches(m, m)] == []
    assert "hybridflow.plan.memory" not in edges["hybridflow.controller.role_models"]
