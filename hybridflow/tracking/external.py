"""TensorBoard and Weights & Biases sinks. Neither package is required: a logger that names one
that is not installed stops at start-up with the pip command. Both get the resolved config."""

from __future__ import annotations

import importlib.util
import math
import secrets
from pathlib import Path

from hybridflow.errors import UserError


def _require(package: str, sink: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise UserError(
            f"trainer.logger lists {sink!r} but {package} is not installed: pip install {package}"
        )


def _markdown_table(rows: list[dict]) -> str:
    keys = list(rows[0])
    cell = lambda v: str(v).replace("|", "\\|").replace("\n", "<br>")  # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
    return "\n".join(lines + ["| " + " | ".join(cell(r[k]) for k in keys) + " |" for r in rows])


class TensorBoardSink:
    """Scalars under their metric names in RUN_DIR/tensorboard; the config and sample tables as text."""

    def __init__(self, run_dir: Path, config_yaml: str) -> None:
        _require("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.writer.add_text("config", "```yaml\n" + config_yaml + "\n```", 0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            if math.isfinite(value):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_samples(self, rows: list[dict], step: int) -> None:
        self.writer.add_text("samples", _markdown_table(rows), step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """One W&B run per run directory (its id kept in RUN_DIR/wandb_run_id, so a resumed run
    continues it); offline with WANDB_MODE=offline, files under RUN_DIR/wandb."""

    def __init__(self, run_dir: Path, config: dict, *, project: str, name: str) -> None:
        _require("wandb", "wandb")
        import wandb

        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        run_dir.mkdir(parents=True, exist_ok=True)
        id_file.write_text(run_id)
        self.wandb = wandb
        self.run = wandb.init(
            project=project, name=name, id=run_id, resume="allow", config=config, dir=str(run_dir)
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log({k: v for k, v in metrics.items() if math.isfinite(v)}, step=step)

    def log_samples(self, rows: list[dict], step: int) -> None:
        columns = list(rows[0])
        table = self.wandb.Table(columns=columns, data=[[r[k] for k in columns] for r in rows])
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()
