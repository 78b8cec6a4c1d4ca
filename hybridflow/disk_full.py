"""A disk that fills up (or a quota reached) mid-run, as one line: what could not be written, and
where the run can go on from once there is room. Libraries say it their own way (safetensors'
SafetensorError, torch.save's RuntimeError, DCP's CheckpointException): the errno or its words are
found anywhere in the error's chain."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from hybridflow.errors import UserError

FULL = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded"}  # the OS's words
_WORDS = {
    "No space left on device": errno.ENOSPC, "os error 28": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT,
    "os error 122": errno.EDQUOT,
}  # fmt: skip


class DiskFull(UserError):
    """The disk filled up: one line naming what could not be written and where to go on from."""


def full_disk(error: BaseException) -> str | None:
    """Why, when `error` (or an error it wraps) is a full disk or quota; else None."""
    seen: set[int] = set()
    todo: list[BaseException] = [error]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in FULL:
            return FULL[e.errno]
        text = str(e)
        for words, code in _WORDS.items():
            if words in text:
                return FULL[code]
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
        failures = getattr(e, "failures", None)  # DCP's CheckpointException: rank -> (error, traceback)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values() if f is not None]
    return None


def size(num_bytes: float) -> str:
    """1.8 MB, 2.3 GB: a size a person reads (a checkpoint of a test model is not '0.0 GB')."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes:.0f} bytes"


def disk_full_error(error: BaseException, run_dir: Path, last_checkpoint: Path | None) -> DiskFull | None:
    """The one line for a run that stopped on a full disk (None for any other error)."""
    why = None if isinstance(error, UserError) else full_disk(error)  # a UserError already says it
    if why is None:
        return None
    written = getattr(error, "filename", None)
    where = f" writing {written}" if written else ""
    go_on = (
        f"the latest complete checkpoint {last_checkpoint.name} is intact: free space and run the same command "
        "to resume from it"
        if last_checkpoint is not None
        else "no checkpoint was written yet: free space and run the same command to start over"
    )
    free = size(_free(run_dir))
    return DiskFull(f"the run stopped: {why}{where} ({free} free under {run_dir}); {go_on}")


def _free(path: Path) -> float:
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return os.statvfs(path).f_bavail * os.statvfs(path).f_frsize
    except OSError:
        return 0.0
