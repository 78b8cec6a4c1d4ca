"""The lines a run ends with: validation before and after, where the policy is, time and disk."""

from __future__ import annotations

from pathlib import Path


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def checkpoint_cost(checkpoint: Path) -> str:
    """'2.27 GB (resume state 1.73 GB, policy/ 0.54 GB)': what one checkpoint of this run costs."""
    parts = {
        "resume state": sum(tree_bytes(p) for p in checkpoint.glob("*_state")),
        "policy/": tree_bytes(checkpoint / "policy") if (checkpoint / "policy").is_dir() else 0,
    }
    inside = ", ".join(f"{name} {gb(size)}" for name, size in parts.items() if size)
    return f"{gb(tree_bytes(checkpoint))} ({inside})"


def run_summary(
    run_dir: Path,
    *,
    steps: int,
    seconds: float,
    first_val: dict[str, float],
    last_val: dict[str, float],
    checkpoint: Path | None,
    keep_last: int,
) -> str:
    lines = [f"summary: {steps} step(s) in {seconds:.0f} s"]
    for key in sorted(set(first_val) | set(last_val)):
        name = key.removeprefix("val-core/")
        before = f"{first_val[key]:.3f}" if key in first_val else "-"
        after = f"{last_val[key]:.3f}" if key in last_val else "-"
        lines.append(f"  validation {name}: {before} -> {after}")
    if checkpoint is not None and (checkpoint / "policy").is_dir():
        lines.append(f"  policy (a transformers directory): {checkpoint / 'policy'}")
        lines.append(
            f"  each checkpoint costs {checkpoint_cost(checkpoint)}; trainer.keep_last_checkpoints={keep_last} are kept"
        )
    lines.append(f"  run directory {run_dir}: {gb(tree_bytes(run_dir))}")
    return "\n".join(lines)
