"""Code rewards: run the response's last fenced code block against the row's tests in the sandbox.

Ground truth forms: {"inputs": [...], "outputs": [...]} (stdin/stdout pairs) or {"asserts": [...]}
(each an assert statement run after the code), or a string of assert lines.
"""

from __future__ import annotations

import json
import re
import secrets

from hybridflow.rewards.sandbox import SandboxLimits, run_python

_FENCE = re.compile(r"```(?:python|py|python3)?[^\n]*\n(.*?)```", re.DOTALL)


def extract_code(solution_str: str) -> str | None:
    blocks = _FENCE.findall(solution_str)
    return blocks[-1] if blocks else None


def _cases(ground_truth) -> list[tuple[str, str, str | None]]:
    """(extra code, stdin, expected stdout or None) per test."""
    if isinstance(ground_truth, str):
        try:
            ground_truth = json.loads(ground_truth)
        except json.JSONDecodeError:
            ground_truth = {"asserts": [line for line in ground_truth.splitlines() if line.strip()]}
    if "asserts" in ground_truth:
        return [("\n" + a, "", None) for a in ground_truth["asserts"]]
    return [("", str(i), str(o)) for i, o in zip(ground_truth["inputs"], ground_truth["outputs"])]


def _same_output(got: str, expected: str) -> bool:
    return [line.rstrip() for line in got.strip().splitlines()] == [
        line.rstrip() for line in expected.strip().splitlines()
    ]


def _asserts_pass(code: str, asserts: str, limits: SandboxLimits | None, hide: tuple[str, ...]) -> bool:
    """Exit status 0 alone would pass a program that leaves early (`os._exit(0)`, `sys.exit()`, an
    atexit hook): the harness also prints a random marker after the last assert, which it read from
    stdin before the program's code ran, and only a run that printed it passes. The code and its
    tests run in their own namespace, so the marker is not one of the program's globals."""
    marker = f"hybridflow-tests-done-{secrets.token_hex(16)}"
    program = (
        "def _hybridflow_harness(source):\n"
        "    import sys\n"
        "    done = sys.stdin.readline().strip()\n"
        "    exec(compile(source, '<solution>', 'exec'), {'__name__': '__main__', '__builtins__': __builtins__})\n"
        "    sys.stdout.write(done + '\\n')\n"
        "    sys.stdout.flush()\n"
        f"_hybridflow_harness({code + chr(10) + asserts + chr(10)!r})\n"
    )
    result = run_python(program, marker + "\n", limits=limits, hide=hide)
    return result.ok and marker in result.stdout.splitlines()


def score(
    solution_str: str,
    ground_truth,
    *,
    all_or_nothing: bool = False,
    limits: SandboxLimits | None = None,
    hide: tuple[str, ...] = (),
) -> dict:
    code = extract_code(solution_str)
    if code is None:
        return {"score": 0.0, "pred": None}
    cases = _cases(ground_truth)
    passed = 0
    for extra, stdin, expected in cases:
        if expected is None:  # assert tests: passed only if the line after the last one runs
            passed += _asserts_pass(code, extra, limits, hide)
            continue
        result = run_python(code + extra, stdin, limits=limits, hide=hide)
        passed += result.ok and _same_output(result.stdout, expected)
    fraction = passed / max(len(cases), 1)
    value = float(passed == len(cases)) if all_or_nothing else fraction
    return {"score": value, "pred": None, "tests_passed": fraction}
