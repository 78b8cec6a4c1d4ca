"""Every Triton kernel compile in a training process, and the step it fell in.

A compile inside a timed step (~0.3-1 s a kernel on an H100) is a one-off that step's time carries.
A kernel compiled again for another batch names an int argument Triton specializes (a value of 1, or
one divisible by 16, gets a variant of its own) that should be do_not_specialize: the rule in
hybridflow/kernels/launch.py.

    python bench/compile_log.py LOG RUN_DIR train key=value ...   # hybridflow.cli, the log on
    compile_log.install(LOG, step_of(steps_file))                  # in a process of one's own

LOG gets a JSON line per compile (or load from Triton's disk cache): the kernel, its specialization
(Triton's repr of the key), the seconds it took, and the step it fell in (`step_of`: the lines a
steps file holds so far + 1, RUN_DIR/metrics.jsonl getting one as each step ends; or any callable
giving a number, such as 1 for a bench's warm-up and 2 for its timed run). `summary` reads it back."""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import triton


def step_of(steps_file: str | Path) -> Callable[[], int]:
    """The step running now: the lines `steps_file` holds (one a finished step) + 1."""
    steps_file = Path(steps_file)
    return lambda: (len(steps_file.read_text().splitlines()) if steps_file.exists() else 0) + 1


def install(log: str | Path, step: Callable[[], int]) -> None:
    """Log this process's compiles to `log` (appending), each with `step()` at its end. Hooks set
    before (another tool's) still run, after these."""
    log = Path(log)
    runtime = triton.knobs.runtime
    earlier_before, earlier_after = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    started: dict[str, float] = {}

    def before_compile(**hook):
        started[str(hook["key"])] = time.perf_counter()
        return earlier_before(**hook) if earlier_before else False  # (True skips the compile)

    def after_compile(**hook):
        began = started.pop(str(hook["key"]), None)
        row = {
            "kernel": getattr(hook["fn"], "name", str(hook["fn"])),
            "step": step(),
            "seconds": None if began is None else round(time.perf_counter() - began, 3),
            "specialization": str(hook.get("repr")),
            "key": str(hook["key"])[:600],  # (the argument types and attributes that made it a variant)
        }
        with log.open("a") as f:
            f.write(json.dumps(row) + "\n")
        return earlier_after(**hook) if earlier_after else None

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = before_compile, after_compile


def summary(log: str | Path, first_timed_step: int = 2) -> dict:
    """Compiles from `first_timed_step` on (the ones inside timed steps): their count and seconds per
    step, and each kernel's count; the same total for the steps before."""
    rows = [json.loads(line) for line in Path(log).read_text().splitlines()] if Path(log).exists() else []
    timed = [r for r in rows if r["step"] >= first_timed_step]
    by_step: dict[int, list] = {}
    for r in timed:
        by_step.setdefault(r["step"], []).append(r)
    return {
        "compiles_before_timed_steps": len(rows) - len(timed),
        "compiles_in_timed_steps": len(timed),
        "seconds_in_timed_steps": round(sum(r["seconds"] or 0.0 for r in timed), 3),
        "by_step": {
            step: {"compiles": len(rs), "seconds": round(sum(r["seconds"] or 0.0 for r in rs), 3)}
            for step, rs in sorted(by_step.items())
        },
        "kernels_in_timed_steps": dict(Counter(r["kernel"] for r in timed).most_common()),
        "specializations_in_timed_steps": sorted({r["specialization"] for r in timed}),
    }


def main() -> int:
    log, run_dir, *cli_args = sys.argv[1:]
    install(log, step_of(Path(run_dir) / "metrics.jsonl"))
    from hybridflow.cli import main as cli_main

    return cli_main(cli_args)


if __name__ == "__main__":
    sys.exit(main())
