"""The files a run keeps in trainer.run_dir: the only ones the trainer writes there, and the only
ones `--overwrite` deletes. A directory holding anything else is refused, so nothing a user put
there is ever overwritten."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from hybridflow.errors import UserError

RUN_FILES = ("metrics.jsonl", "samples.jsonl", "config.yaml", "step_plan.txt", "report.html", "wandb_run_id")
RUN_FOLDERS = ("checkpoints", "rollout_start_policy", "tensorboard", "wandb", "inputs")


def check_run_dir(run_dir: Path, *, resume: str, overwrite: bool) -> None:
    if not run_dir.exists():
        return
    if any(p.name not in RUN_FILES + RUN_FOLDERS for p in run_dir.iterdir()):
        raise UserError(
            f"run directory {run_dir} holds files this trainer did not write; choose another trainer.run_dir"
        )
    if resume == "disable" and not overwrite and any(run_dir.iterdir()):
        raise UserError(
            f"run directory {run_dir} is not empty and trainer.resume=disable; choose another trainer.run_dir"
        )


def clear_run_dir(run_dir: Path) -> None:
    """Start over: this run's checkpoints, metrics, samples, report and tracker files go."""
    for name in RUN_FOLDERS:
        shutil.rmtree(run_dir / name, ignore_errors=True)
    for name in RUN_FILES:
        (run_dir / name).unlink(missing_ok=True)


def prepare_run_dir(config, *, overwrite: bool) -> Path:
    """trainer.run_dir, checked (and emptied of this run's files with `overwrite`)."""
    if getattr(sys.modules.get("__main__"), "__name__", None) == "__mp_main__":
        # a spawned worker (reward scoring) re-imports the user's script: a script that trains at
        # import would start a second run here, over the first one's directory
        raise UserError(
            "a training run was started inside a worker process: the script starts training when it is "
            'imported; put that code under `if __name__ == "__main__":`'
        )
    run_dir = Path(config.trainer.run_dir)
    check_run_dir(run_dir, resume=config.trainer.resume, overwrite=overwrite)
    if overwrite:
        clear_run_dir(run_dir)
    return run_dir
