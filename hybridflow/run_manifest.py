"""RUN_DIR/.hybridflow-written: the entries hybridflow created inside the run directory's shared
folders (`checkpoints/global_step_N`, `inputs/actor`, ...), one relative path a line. Only what is
listed here is ever deleted (--overwrite, keep_last_checkpoints, a killed save's leftovers): a folder
of the user's named like ours (`checkpoints/global_step_7`) stays.

A run directory from before this file existed is trusted by name once: its entries that match our
names are listed when a run first starts there (`adopt_by_name`)."""

from __future__ import annotations

import os
import re
from pathlib import Path

WRITTEN = ".hybridflow-written"


def _file(run_dir: Path) -> Path:
    return Path(run_dir) / WRITTEN


def written(run_dir: Path) -> set[str]:
    try:
        return set(_file(run_dir).read_text(encoding="utf-8").splitlines()) - {""}
    except FileNotFoundError:
        return set()


def tmp_name(name: str) -> str:
    """The hidden name a file is written under before it replaces `name`."""
    return f"{name}.tmp" if name.startswith(".") else f".{name}.tmp"


def write_text_atomic(path: Path, text: str) -> None:
    """`path` holds `text` whole, or what it held before: written beside it, flushed to the disk,
    then renamed over it (a kill or a full disk mid-write never leaves half a file)."""
    tmp = path.with_name(tmp_name(path.name))
    try:
        with tmp.open("w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _store(run_dir: Path, entries: set[str]) -> None:
    write_text_atomic(_file(run_dir), "".join(f"{e}\n" for e in sorted(entries)))


def relative(run_dir: Path, path: Path) -> str:
    return Path(os.path.abspath(path)).relative_to(os.path.abspath(run_dir)).as_posix()


def record(run_dir: Path, path: Path) -> None:
    """`path` (inside run_dir) is ours: list it before writing there."""
    entries = written(run_dir)
    entry = relative(run_dir, path)
    if entry not in entries:
        _store(run_dir, entries | {entry})


def forget(run_dir: Path, paths: list[Path]) -> None:
    entries = written(run_dir)
    gone = {relative(run_dir, p) for p in paths}
    if entries & gone:
        _store(run_dir, entries - gone)


def is_ours(run_dir: Path, path: Path) -> bool:
    return relative(run_dir, path) in written(run_dir)


def adopt_by_name(run_dir: Path, patterns: dict[str, re.Pattern]) -> None:
    """A run directory a hybridflow run used before this list existed: its entries with our names."""
    if _file(run_dir).exists():
        return
    found = {
        f"{folder}/{entry.name}"
        for folder, pattern in patterns.items()
        if (run_dir / folder).is_dir()
        for entry in (run_dir / folder).iterdir()
        if pattern.fullmatch(entry.name)
    }
    if found:
        _store(run_dir, found)
