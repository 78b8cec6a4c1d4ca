"""Metric sinks, chosen by trainer.logger: a compact console line per step, metrics.jsonl with every
metric, TensorBoard and Weights & Biases (tracking/external.py). Sample generations go to
samples.jsonl always, and to the sinks that can show a table."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Protocol

from tqdm import tqdm

from hybridflow.errors import UserError
from hybridflow.run_manifest import tmp_name


class Sink(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...
    def close(self) -> None: ...


SINKS = ("console", "jsonl", "tensorboard", "wandb", "prometheus")


class ConsoleSink:
    """One line a step that reads like the step itself:
    [step 3] rollout 8 prompts -> 64 responses (avg len 42) | reward mean 0.41 std 0.22 | kl 0.021 |
    loss actor 0.18 critic 0.42 | entropy 0.51 | 6.1 s | gsm8k/acc/mean@1 0.400
    (offline trainers: loss, val_loss, grad). Parts whose metrics a step lacks are left out."""

    OFFLINE = (("train/loss", "loss"), ("val/loss", "val_loss"), ("train/grad_norm", "grad"))

    def __init__(self, styled: bool | None = None) -> None:
        """`styled`: bold numbers and a bold step number (default: when stdout is a terminal)."""
        self.styled = sys.stdout.isatty() if styled is None else styled

    def line(self, metrics: dict[str, float], step: int) -> str:
        m = metrics

        def num(value: float, spec: str = ".3g") -> str:
            text = format(value, spec)
            return f"\033[1m{text}\033[0m" if self.styled else text

        parts = []
        if "rollout/responses" in m:
            part = f"rollout {num(m['rollout/prompts'], '.0f')} prompts -> {num(m['rollout/responses'], '.0f')} responses"
            if "response_length/mean" in m:
                part += f" (avg len {num(m['response_length/mean'], '.0f')})"
            parts.append(part)
        if "critic/score/mean" in m:
            part = f"reward mean {num(m['critic/score/mean'])}"
            if "critic/score/std" in m:
                part += f" std {num(m['critic/score/std'])}"
            failed = [
                f"{m[k]:.0f} {k.split('/')[1]}" for k in ("reward/errors", "reward/timeouts") if m.get(k)
            ]
            if failed:  # scored 0: the reward mean is not what the function would have said
                part += f" ({', '.join(failed)})"
            parts.append(part)
        kl = next((k for k in ("actor/kl_loss", "critic/kl") if k in m), None)  # KL loss, or KL in the reward
        if kl:
            parts.append(f"kl {num(m[kl])}")
        losses = [
            (name, m[key])
            for name, key in (("actor", "actor/pg_loss"), ("critic", "critic/vf_loss"))
            if key in m
        ]
        if losses:
            parts.append("loss " + " ".join(f"{name} {num(v)}" for name, v in losses))
        if "actor/entropy" in m:
            parts.append(f"entropy {num(m['actor/entropy'])}")
        parts += [f"{label} {num(m[key], '.4g')}" for key, label in self.OFFLINE if key in m]
        if "timing_s/step" in m:
            parts.append(f"{num(m['timing_s/step'])} s")
        parts += [
            f"{k.split('/', 1)[1]} {num(v, '.3f')}"
            for k, v in m.items()
            if k.startswith("val-core/") and "/mean@" in k
        ]
        head = f"\033[1m[step {step}]\033[0m" if self.styled else f"[step {step}]"
        return f"{head} {' | '.join(parts)}" if parts else head

    def log(self, metrics: dict[str, float], step: int) -> None:
        tqdm.write(self.line(metrics, step), file=sys.stdout)  # above a progress bar, when one is drawn

    def close(self) -> None:
        pass


class JsonlSink:
    """One JSON object per step: {"step": int, metric: value, ...}; appends (a resumed run continues the file)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a", encoding="utf-8")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.file.write(json.dumps(jsonl_row(metrics, step)) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def make_sinks(names: list[str], run_dir: Path, config) -> list[Sink]:
    """The sinks `names` lists, and metrics.jsonl always (the run's record: the report, a resume and
    `hybridflow report` read it); `config` (the resolved Config) goes to those that keep it."""
    from hybridflow.config.loader import to_dict, to_yaml
    from hybridflow.tracking.external import TensorBoardSink, WandbSink

    unknown = [n for n in names if n not in SINKS]
    if unknown:
        raise UserError(f"trainer.logger: unknown sink {unknown[0]!r} (available: {', '.join(SINKS)})")
    sinks: list[Sink] = [JsonlSink(run_dir / "metrics.jsonl")]
    for name in dict.fromkeys(names):
        if name == "console":
            sinks.append(ConsoleSink())
        elif name == "jsonl":
            pass  # always written
        elif name == "tensorboard":
            sinks.append(TensorBoardSink(run_dir, to_yaml(config)))
        elif name == "prometheus":
            from hybridflow.tracking.prometheus import PrometheusSink

            t = config.trainer
            sinks.append(PrometheusSink(t.prometheus_host, t.prometheus_port, t.experiment_name))
        else:
            t = config.trainer
            sinks.append(WandbSink(run_dir, to_dict(config), project=t.project_name, name=t.experiment_name))
    return sinks


def jsonl_row(metrics: dict[str, float], step: int) -> dict:
    """{"step": step, metric: value, ...}, a non-finite value as null (strict JSON)."""
    return {"step": step, **{k: (v if math.isfinite(v) else None) for k, v in metrics.items()}}


def _rows(path: Path):
    """(byte offset, parsed row or None) of each line; a last line without its newline (a write a
    kill or a full disk cut short) is torn and read as None."""
    offset = 0
    with path.open("rb") as f:
        for raw in f:
            row = None
            if raw.endswith(b"\n") and raw.strip():
                try:
                    row = json.loads(raw)
                except ValueError:
                    row = None
            yield offset, row if isinstance(row, dict) else None, raw
            offset += len(raw)


def restore_last_row(path: Path, step: int, row: dict | None) -> None:
    """After resuming from checkpoint `step`: a run killed after that checkpoint was written but
    before the step's metrics reached `path` gets the row the checkpoint kept, so no step is missing.
    Call after `truncate_jsonl`, which leaves no torn line at the end."""
    if row is None:
        return
    last = None
    if path.exists():
        for _, parsed, _ in _rows(path):
            last = parsed if parsed is not None else last
    if last is not None and last.get("step") == step:
        return
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop the lines past `last_step` (written after the checkpoint a run resumes from) and a torn
    last line. When those lines are the file's tail (as a run appends them) the file is cut where they
    start, in one truncate call; otherwise the kept lines are written to a new file that replaces it.
    Either way a kill at any moment leaves the old file or the new one, never less history."""
    if not path.exists():
        return
    cut, in_order = None, True
    for offset, row, raw in _rows(path):
        past = (row is None and not raw.endswith(b"\n")) or (
            row is not None and row.get("step", 0) > last_step
        )
        if past and cut is None:
            cut = offset
        elif not past and cut is not None:
            in_order = False
    if cut is None:
        return
    if in_order:
        os.truncate(path, cut)
        return
    tmp = path.with_name(tmp_name(path.name))
    with tmp.open("wb") as f:
        for _, row, raw in _rows(path):
            if raw.endswith(b"\n") and (row is None or row.get("step", 0) <= last_step):
                f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
