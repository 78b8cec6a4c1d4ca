"""Built-in tasks that write a dataset offline from a seed: arithmetic, countdown, guess_number."""

from __future__ import annotations

from pathlib import Path

from hybridflow.data.files import write_rows
from hybridflow.data.tasks import arithmetic, countdown, guess_number
from hybridflow.errors import UserError

TASKS = {
    "arithmetic": (arithmetic.make_rows, arithmetic.ArithmeticSpec),
    "countdown": (countdown.make_rows, countdown.CountdownSpec),
    "guess_number": (guess_number.make_rows, guess_number.GuessNumberSpec),
}


def _row_key(task: str, row: dict) -> str:
    if task == "arithmetic":
        return row["extra_info"]["expression"]
    if task == "guess_number":  # each row is a game of its own
        return row["extra_info"]["game"]
    gt = row["reward_model"]["ground_truth"]
    return f"{sorted(gt['numbers'])}->{gt['target']}"


def make_task(
    task: str, out_dir: str | Path, *, train_size: int = 2000, test_size: int = 200, seed: int = 0, **spec
) -> dict[str, Path]:
    """Write OUT/train.parquet and OUT/test.parquet; test problems never appear in train."""
    if task not in TASKS:
        raise UserError(f"unknown task {task!r}; built-in tasks: {', '.join(TASKS)}")
    make_rows, spec_cls = TASKS[task]
    try:
        task_spec = spec_cls(**spec)
    except (TypeError, ValueError) as e:
        raise UserError(f"task {task}: {e}") from e
    try:
        test = make_rows(test_size, seed=seed, split="test", spec=task_spec)
        train = make_rows(
            train_size, seed=seed, split="train", spec=task_spec, exclude={_row_key(task, r) for r in test}
        )
    except ValueError as e:  # too few distinct problems for the sizes asked
        raise UserError(f"task {task} (data.task_options): {e}") from e
    out = Path(out_dir)
    return {"train": write_rows(train, out / "train.parquet"), "test": write_rows(test, out / "test.parquet")}


def cached_task(task: str, options: dict, cache_root: Path) -> dict[str, Path]:
    """The task's train/test files under the cache, written once per distinct set of options."""
    import hashlib
    import json

    key = hashlib.sha256(json.dumps({"task": task, **options}, sort_keys=True).encode()).hexdigest()[:12]
    out = cache_root / "tasks" / f"{task}-{key}"
    paths = {"train": out / "train.parquet", "test": out / "test.parquet"}
    if not all(p.is_file() for p in paths.values()):
        import shutil
        import tempfile

        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        make_task(task, tmp, **options)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    return paths


def use_task_files(config) -> None:
    """With data.task set and no data.train_files, point data.train_files (and data.val_files, unless
    given) at the task's cached train and test files."""
    from hybridflow.models.default import cache_root

    data = config.data
    if data.task and not data.train_files:
        files = cached_task(data.task, dict(data.task_options), cache_root(config.model.cache_dir))
        data.train_files, data.val_files = [str(files["train"])], data.val_files or [str(files["test"])]
