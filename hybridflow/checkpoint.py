"""Checkpoints: written atomically (temporary directory, then rename), newest K kept, loaded safely.

Layout of RUN_DIR/checkpoints/global_step_N/:
  policy/            HF directory of the policy (transformers loads it as-is)
  critic/            HF directory of the value model (GAE only)
  actor_state/       the actor's weights + optimizer state (torch.distributed.checkpoint: saved by
                     N ranks, loadable by any number)
  critic_state/      the same for the critic (GAE only)
  optim.pt           LR scheduler states (loaded with weights_only=True)
  trainer_state.json step, data position, KL controller, RNG states, counters
  config.yaml        the resolved config
  manifest.json      every file's size and sha256, checked before a checkpoint is resumed from: a
                     damaged one is skipped (with a warning naming the file) for the one before it
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pickle
import random
import re
import secrets
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from hybridflow import run_manifest
from hybridflow.disk_full import DiskFull, full_disk, size
from hybridflow.errors import UserError
from hybridflow.permissions import as_user_files

_STEP_DIR = re.compile(r"^global_step_(\d+)$")
MANIFEST = "manifest.json"
log = logging.getLogger(__name__)


def writes_checkpoints(save_freq: int | None) -> bool:
    return save_freq is None or save_freq > 0


NO_CHECKPOINTS = (
    "no checkpoints (trainer.save_freq 0 or -1, verl's 'never'): the trained weights are not kept"
)


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (a half-written one has a temporary name and is never listed), by step."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and child.is_dir() and (child / "trainer_state.json").is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest_checkpoint(run_dir: Path, *, unverified: bool = False) -> Path | None:
    """The newest complete checkpoint whose files match its manifest; a damaged or unverifiable one is
    skipped with a warning (and kept on disk). None when there is none; an error when every one is
    damaged. `unverified`: a checkpoint without a usable manifest is taken as it is."""
    found = list_checkpoints(run_dir)
    problems = []
    for _, path in reversed(found):
        problem = checkpoint_problem(path, unverified=unverified)
        if problem is None:
            return path
        problems.append(f"{path.name}: {problem}")
        log.warning("checkpoint %s is damaged (%s); skipping it", path, problem)
    if problems:
        raise UserError(
            f"every checkpoint in {checkpoint_root(run_dir)} is damaged or unverifiable ({problems[0]}); move "
            "them away to start over (a checkpoint written before manifests existed: trainer.resume_unverified=true)"
        )
    return None


def latest_checkpoint_name(run_dir: Path) -> str | None:
    found = list_checkpoints(run_dir)
    return found[-1][1].name if found else None


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, read a MiB at a time."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _sha256s(files: list[Path]) -> list[str]:
    """The files' sha256, several at once (hashlib releases the GIL: a sharded state's files, one
    per rank, hash in parallel; a single file runs at one core's ~1.4 GB/s)."""
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
        return list(pool.map(file_sha256, files))


def write_manifest(directory: Path) -> None:
    """manifest.json: {relative path: {bytes, sha256}} of every file under `directory`."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {
        str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": digest}
        for p, digest in zip(files, _sha256s(files))
    }
    (directory / MANIFEST).write_text(json.dumps(entries, indent=0), encoding="utf-8")


def _manifest_entries(path: Path) -> tuple[dict[str, dict] | None, str | None]:
    """(entries, None) of a well-formed manifest, else (None, what is wrong with it)."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return None, f"it has no {MANIFEST}, so its files cannot be verified"
    try:
        entries = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return None, f"{MANIFEST} unreadable ({e})"
    well_formed = isinstance(entries, dict) and all(
        isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get("sha256"), str)
        for e in entries.values()
    )
    if not well_formed:
        return None, f"{MANIFEST} is malformed (not a mapping of file -> bytes, sha256)"
    if not entries:
        return None, f"{MANIFEST} lists no files"
    return entries, None


def checkpoint_problem(path: Path, *, unverified: bool = False) -> str | None:
    """What is wrong with a checkpoint's files against its manifest, or None. A missing, empty or
    malformed manifest is a problem too, unless `unverified` (trainer.resume_unverified: a checkpoint
    written before manifests existed), and so is a file the manifest does not list."""
    entries, problem = _manifest_entries(path)
    if entries is None:
        return None if unverified else problem
    listed = set(entries) | {MANIFEST}
    extra = sorted(
        str(p.relative_to(path))
        for p in path.rglob("*")
        if p.is_file() and str(p.relative_to(path)) not in listed
    )
    if extra:
        return f"{extra[0]} is not in its {MANIFEST}"
    for name, entry in entries.items():  # sizes first: cheap, and they catch truncation
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != entry["bytes"]:
            return f"{name} has {file.stat().st_size} bytes, the manifest says {entry['bytes']}"
    digests = _sha256s([path / name for name in entries])
    for (name, entry), digest in zip(entries.items(), digests):
        if digest != entry["sha256"]:
            return f"{name} does not match its sha256"
    return None


def rng_state() -> dict[str, Any]:
    version, state, gauss = random.getstate()
    return {"python": [version, list(state), gauss], "torch": torch.get_rng_state().tolist()}


def set_rng_state(state: dict[str, Any]) -> None:
    version, inner, gauss = state["python"]
    random.setstate((version, tuple(inner), gauss))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def save_checkpoint(
    run_dir: Path,
    step: int,
    *,
    write_models: Callable[[Path], None],
    optim_state: dict[str, Any],
    trainer_state: dict[str, Any],
    config_yaml: str,
    keep_last: int,
    needed_bytes: int = 0,
) -> Path:
    """Write global_step_{step} atomically; `write_models(directory)` writes the models (and their
    sharded states) into the checkpoint's directory. Older checkpoints beyond `keep_last` are deleted (only ones this run's layout names)."""
    root = checkpoint_root(run_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(
            f"cannot create {root} for checkpoints: {e.strerror or e}; check trainer.run_dir"
        ) from e
    target = root / f"global_step_{step}"
    stale = [p for p in root.glob(".tmp-global_step_*") if run_manifest.is_ours(run_dir, p)]
    for leftover in stale:  # what a killed save of ours left
        shutil.rmtree(leftover, ignore_errors=True)
    run_manifest.forget(run_dir, stale)
    free = shutil.disk_usage(root).free
    earlier = latest_checkpoint_name(run_dir)
    intact = f"; {earlier} is intact" if earlier else ""
    if free < needed_bytes:  # a disk that fills up half-way leaves an obscure writer error
        raise DiskFull(
            f"checkpoint global_step_{step} needs about {size(needed_bytes)} in {root} but only "
            f"{size(free)} are free{intact}; free some space (then run the same command), lower "
            "trainer.keep_last_checkpoints, or move trainer.run_dir"
        )
    tmp = root / f".tmp-global_step_{step}-{secrets.token_hex(4)}"
    try:
        run_manifest.record(run_dir, tmp)  # listed before it exists: a kill right after mkdir leaves it ours
        tmp.mkdir(mode=0o700)
        write_models(tmp)
        torch.save(optim_state, tmp / "optim.pt")
        (tmp / "config.yaml").write_text(config_yaml, encoding="utf-8")
        # the state file marks a complete checkpoint; the manifest covers every file
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state), encoding="utf-8")
        write_manifest(tmp)
        as_user_files(tmp)
        if target.exists() and not run_manifest.is_ours(run_dir, target):
            raise UserError(
                f"{target} exists and hybridflow did not write it; move it away or choose another trainer.run_dir"
            )
        if target.exists():
            shutil.rmtree(target)
        run_manifest.record(run_dir, target)
        os.replace(tmp, target)
        run_manifest.forget(run_dir, [tmp])
    except Exception as e:  # disk full, quota, read-only or unwritable folder, ...
        shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(OSError):
            run_manifest.forget(run_dir, [tmp])
        why = full_disk(e) or (e.strerror if isinstance(e, OSError) else None)
        if why is None:
            raise
        raise (DiskFull if full_disk(e) else UserError)(
            f"checkpoint global_step_{step} could not be written in {root}: {why} "
            f"({getattr(e, 'filename', None) or 'while writing'}); nothing of it was kept{intact}"
            + ("; free space and run the same command to go on from it" if earlier and full_disk(e) else "")
        ) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(OSError):
            run_manifest.forget(run_dir, [tmp])
        raise
    old = [p for _, p in list_checkpoints(run_dir)[:-keep_last]] if keep_last > 0 else []
    for path in (p for p in old if run_manifest.is_ours(run_dir, p)):
        shutil.rmtree(path)
        run_manifest.forget(run_dir, [path])
    return target


def load_checkpoint_state(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(trainer_state, optim_state); tensors only, no pickled code (weights_only=True)."""
    trainer_state = json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))
    try:
        optim_state = torch.load(path / "optim.pt", map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # weights_only refuses anything but tensors and plain data
        raise UserError(
            f"{path / 'optim.pt'} holds more than tensors and plain data (pickled code?); refused, not run: "
            f"{str(e).splitlines()[0]}"
        ) from e
    return trainer_state, optim_state


# What a resumed run must share with the checkpoint it goes on from (else it trains something else)
RESUME_IDENTITY = (
    "model.path",
    "model.lora_rank",
    "data.train_files",
    "data.task",
    "data.task_options",
    "algorithm.adv_estimator",
)


def check_resumable(path: Path, config_yaml: str, *, force: bool) -> None:
    """Refuse to go on from checkpoint `path` when it was written with another model, data or
    algorithm than `config_yaml` (naming each difference), unless `force` (trainer.resume=force)."""
    from omegaconf import OmegaConf

    saved_file = path / "config.yaml"
    if force or not saved_file.is_file():
        return
    saved = OmegaConf.to_container(OmegaConf.load(saved_file), resolve=False)
    now = OmegaConf.to_container(OmegaConf.create(config_yaml), resolve=False)

    def get(tree: dict, key: str) -> Any:
        for part in key.split("."):
            tree = tree.get(part) if isinstance(tree, dict) else None
        return tree

    differ = [
        f"{k}: {get(saved, k)!r} there, {get(now, k)!r} now"
        for k in RESUME_IDENTITY
        if get(saved, k) != get(now, k)
    ]
    if differ:
        raise UserError(
            f"the latest checkpoint {path} was made by another run ({'; '.join(differ)}); use another "
            "trainer.run_dir (or trainer.experiment_name), --overwrite to start over, or "
            "trainer.resume=force to go on from it anyway"
        )
