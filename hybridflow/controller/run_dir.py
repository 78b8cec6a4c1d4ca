"""The files a run keeps in trainer.run_dir: the only ones the trainer writes there, and the only
ones `--overwrite` deletes. A directory holding anything else is refused, so nothing a user put
there is ever overwritten."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path

from hybridflow.errors import UserError
from hybridflow.run_manifest import WRITTEN, adopt_by_name, is_ours, tmp_name

LOCK = ".hybridflow.lock"
RUN_FILES = (
    "metrics.jsonl",
    "samples.jsonl",
    "config.yaml",
    "step_plan.txt",
    "report.html",
    "wandb_run_id",
    "policy_server.json",
    LOCK,
    WRITTEN,
)
# what a kill in the middle of an atomic rewrite leaves beside a file (run_manifest.write_text_atomic;
# replaced by the next rewrite)
RUN_FILES = (*RUN_FILES, *(tmp_name(name) for name in RUN_FILES))
RUN_FOLDERS = ("checkpoints", "rollout_start_policy", "tensorboard", "wandb", "inputs")


# inside these RUN_FOLDERS an entry is ours only if run_manifest lists it (anything else there is
# the user's and stays); the names are what a directory from before that list is trusted by
OURS_INSIDE = {
    "checkpoints": re.compile(r"(global_step_\d+|\.tmp-global_step_\d+-.*)"),
    "inputs": re.compile(r"(actor|ref|critic|train\.jsonl|eval\.jsonl)"),
}


def check_run_dir(run_dir: Path, *, resume: str, overwrite: bool) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(
            f"trainer.run_dir {run_dir} is a file, not a directory; choose another trainer.run_dir"
        )
    writable_parent = next((p for p in (run_dir, *run_dir.absolute().parents) if p.exists()), None)
    if writable_parent is not None and not os.access(writable_parent, os.W_OK | os.X_OK):
        raise UserError(
            f"trainer.run_dir {run_dir} cannot be written: {writable_parent} is not writable by this user; "
            "choose another trainer.run_dir"
        )
    if not run_dir.exists():
        return
    names = {p.name for p in run_dir.iterdir()}
    if names - set(RUN_FILES + RUN_FOLDERS):
        raise UserError(
            f"run directory {run_dir} holds files this trainer did not write; choose another trainer.run_dir"
        )
    if names - {LOCK} and LOCK not in names and not overwrite:
        raise UserError(
            f"run directory {run_dir} holds {', '.join(sorted(names))} but no {LOCK}: no hybridflow run was "
            "started there (or one before lock files); choose another trainer.run_dir, or pass --overwrite "
            "to replace them"
        )
    if resume == "disable" and not overwrite and any(p.name != LOCK for p in run_dir.iterdir()):
        raise UserError(
            f"run directory {run_dir} is not empty and trainer.resume=disable; choose another trainer.run_dir"
        )


def clear_run_dir(run_dir: Path) -> None:
    """Start over: this run's checkpoints, metrics, samples, report and tracker files go."""
    for name in RUN_FOLDERS:
        folder = run_dir / name
        if name not in OURS_INSIDE:  # written by us or by the tracker we started, whole
            shutil.rmtree(folder, ignore_errors=True)
            continue
        for entry in folder.iterdir() if folder.is_dir() else ():
            if is_ours(run_dir, entry):
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
    for name in RUN_FILES:
        if name != LOCK:  # held by this run
            (run_dir / name).unlink(missing_ok=True)  # the list of what we wrote too: all of it is gone


class RunLock:
    """This process's exclusive hold on a run directory, from the start of a run to its close: a
    second run into the same directory stops at once, naming the first. The kernel drops the lock
    when the holder dies (flock), so a killed run never leaves the directory locked."""

    def __init__(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.file = (run_dir / LOCK).open("a+", encoding="utf-8")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.seek(0)
            holder = self.file.read().strip() or "another process"
            self.file.close()
            raise UserError(
                f"run directory {run_dir} is in use by {holder}; wait for that run to end, or choose "
                "another trainer.run_dir"
            ) from None
        self.file.seek(0)
        self.file.truncate()
        self.file.write(
            f"the run of pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
        )
        self.file.flush()

    def release(self) -> None:
        if not self.file.closed:
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()


def prepare_run_dir(config, *, overwrite: bool) -> tuple[Path, RunLock]:
    """trainer.run_dir, checked, locked for this run (and emptied of this run's files with
    `overwrite`)."""
    if getattr(sys.modules.get("__main__"), "__name__", None) == "__mp_main__":
        # a spawned worker (reward scoring) re-imports the user's script: a script that trains at
        # import would start a second run here, over the first one's directory
        raise UserError(
            "a training run was started inside a worker process: the script starts training when it is "
            'imported; put that code under `if __name__ == "__main__":`'
        )
    run_dir = Path(config.trainer.run_dir)
    check_run_dir(run_dir, resume=config.trainer.resume, overwrite=overwrite)
    lock = RunLock(run_dir)
    adopt_by_name(run_dir, OURS_INSIDE)
    if overwrite:
        clear_run_dir(run_dir)
    return run_dir, lock
