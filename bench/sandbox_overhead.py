"""What the code sandbox costs per program: `run_python('print(1)')` against the same program run
by a bare subprocess of the same interpreter (the baseline), measured in one run.

    .venv/bin/python bench/sandbox_overhead.py [--runs 30]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

from hybridflow.rewards.sandbox import run_python, sandbox_python


def timed(fn, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1000)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=30)
    runs = parser.parse_args().runs
    python = sandbox_python()
    bare = timed(
        lambda: subprocess.run([python, "-I", "-S", "-c", "print(1)"], check=True, capture_output=True), runs
    )
    limited_by = run_python("print(1)").limited_by
    sandboxed = timed(lambda: run_python("print(1)"), runs)
    print(f"{runs} runs each; sandbox limits by {limited_by}")
    for name, values in (("bare subprocess", bare), ("sandbox", sandboxed)):
        print(
            f"{name:16s} median {statistics.median(values):6.1f} ms   p90 {sorted(values)[int(0.9 * runs)]:6.1f} ms"
        )


if __name__ == "__main__":
    main()
