"""Metric sinks, chosen by trainer.logger: a compact console line per step, metrics.jsonl with every
metric, TensorBoard and Weights & Biases (tracking/external.py). Sample generations go to
samples.jsonl always, and to the sinks that can show a table."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Protocol

from tqdm import tqdm

from hybridflow.errors import UserError


class Sink(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...
    def close(self) -> None: ...


SINKS = ("console", "jsonl", "tensorboard", "wandb")


class ConsoleSink:
    KEYS = (
        ("critic/score/mean", "score"),
        ("actor/pg_loss", "pg_loss"),
        ("actor/kl_loss", "kl"),
        ("actor/entropy", "entropy"),
        ("actor/grad_norm", "grad"),
        ("critic/vf_loss", "vf_loss"),
        ("response_length/mean", "resp_len"),
        ("train/loss", "loss"),  # SFT
        ("val/loss", "val_loss"),
        ("train/grad_norm", "grad"),
        ("timing_s/step", "s"),
    )

    def __init__(self, styled: bool | None = None) -> None:
        """`styled`: bold labels and a bold step number (default: when stdout is a terminal)."""
        self.styled = sys.stdout.isatty() if styled is None else styled

    def log(self, metrics: dict[str, float], step: int) -> None:
        bold = (lambda t: f"\033[1m{t}\033[0m") if self.styled else (lambda t: t)
        parts = [bold(f"[step {step}]")]
        for key, label in self.KEYS:
            if key in metrics:
                parts.append(f"{label} {bold(f'{metrics[key]:.4g}')}")
        parts += [
            f"{k.split('/', 1)[1]} {bold(f'{v:.3f}')}"
            for k, v in metrics.items()
            if k.startswith("val-core/") and "/mean@" in k
        ]
        tqdm.write(" | ".join(parts), file=sys.stdout)  # above a progress bar, when one is drawn

    def close(self) -> None:
        pass


class JsonlSink:
    """One JSON object per step: {"step": int, metric: value, ...}; appends (a resumed run continues the file)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a", encoding="utf-8")

    def log(self, metrics: dict[str, float], step: int) -> None:
        clean = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
        self.file.write(json.dumps({"step": step, **clean}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def make_sinks(names: list[str], run_dir: Path, config) -> list[Sink]:
    """The sinks `names` lists; `config` (the resolved Config) goes to those that keep it."""
    from hybridflow.config.loader import to_dict, to_yaml
    from hybridflow.tracking.external import TensorBoardSink, WandbSink

    unknown = [n for n in names if n not in SINKS]
    if unknown:
        raise UserError(f"trainer.logger: unknown sink {unknown[0]!r} (available: {', '.join(SINKS)})")
    sinks: list[Sink] = []
    for name in names:
        if name == "console":
            sinks.append(ConsoleSink())
        elif name == "jsonl":
            sinks.append(JsonlSink(run_dir / "metrics.jsonl"))
        elif name == "tensorboard":
            sinks.append(TensorBoardSink(run_dir, to_yaml(config)))
        else:
            t = config.trainer
            sinks.append(WandbSink(run_dir, to_dict(config), project=t.project_name, name=t.experiment_name))
    return sinks


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop lines past `last_step` (written after the checkpoint a run resumes from)."""
    if not path.exists():
        return
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    kept = [line for line in lines if json.loads(line).get("step", 0) <= last_step]
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
