"""What a report reads from a run directory: metrics.jsonl, samples.jsonl, config.yaml and
step_plan.txt (the last two written by the trainer when it starts)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from hybridflow.errors import UserError


@dataclass
class Run:
    name: str
    steps: list[dict]  # metrics.jsonl rows, by step (the last row of a step wins)
    samples: list[dict] = field(default_factory=list)
    config_yaml: str = ""
    step_plan: str = ""

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) where `key` was logged with a finite value."""
        points = [(m["step"], m[key]) for m in self.steps if m.get(key) is not None]
        return [s for s, _ in points], [v for _, v in points]

    def metric_keys(self) -> set[str]:
        return {k for m in self.steps for k in m}


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                if number == len(lines) and not text.endswith("\n"):
                    break  # a last line cut short (a kill or a full disk mid-write)
                raise UserError(f"{path}: line {number} is not JSON ({e.msg})") from e
    return rows


def load_run(directory: str | Path) -> Run:
    path = Path(directory)
    if not (path / "metrics.jsonl").is_file():
        raise UserError(f"{path} has no metrics.jsonl: not a hybridflow run directory")
    by_step = {row["step"]: row for row in _jsonl(path / "metrics.jsonl")}
    read = lambda name: (path / name).read_text(encoding="utf-8") if (path / name).is_file() else ""  # noqa: E731
    return Run(
        name=path.resolve().name,
        steps=[by_step[s] for s in sorted(by_step)],
        samples=_jsonl(path / "samples.jsonl"),
        config_yaml=read("config.yaml"),
        step_plan=read("step_plan.txt"),
    )
