"""Every sandbox limit, tried: each hostile program is stopped, scores 0, and harms nothing here."""

import os
import time
from pathlib import Path

import pytest

from hybridflow.rewards import compute_score
from hybridflow.rewards.sandbox import SandboxLimits, available, run_python

# no skip where the sandbox is missing: scoring code needs it, so its absence is a failure
assert available(), "the code sandbox needs util-linux (unshare, mount, setpriv) and libseccomp"
LIMITS = SandboxLimits(wall_s=3.0, cpu_s=2, memory_mb=512, output_bytes=100_000, disk_mb=4)


def run(code, stdin="", hide=()):
    return run_python(code, stdin, limits=LIMITS, hide=hide)


def test_ordinary_program_reads_stdin_and_uses_scratch():
    r = run(
        "import sys\nopen('f.txt', 'w').write(sys.stdin.read()[::-1])\nprint(open('f.txt').read())", "abc"
    )
    assert r.ok and r.stdout.strip() == "cba"


def test_infinite_loop_is_stopped():
    start = time.monotonic()
    r = run("while True:\n    pass")
    assert not r.ok and time.monotonic() - start < LIMITS.wall_s + 2


def test_fork_bomb_is_contained():
    start = time.monotonic()
    r = run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    assert not r.ok and time.monotonic() - start < LIMITS.wall_s + 3
    # killing the namespace's first process takes every process in it down; give the kernel a moment
    deadline = time.monotonic() + 5
    while os.system("pgrep -u nobody python >/dev/null") == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert os.system("pgrep -u nobody python >/dev/null") != 0  # nothing left behind


def test_ten_gigabyte_allocation_fails():
    r = run("x = bytearray(10 * 1024**3)\nprint('allocated')")
    assert not r.ok and "allocated" not in r.stdout and "MemoryError" in r.stderr


def test_writes_outside_scratch_fail(tmp_path):
    target = tmp_path / "escape.txt"
    r = run(f"open({str(target)!r}, 'w').write('x')\nprint('wrote')")
    assert not r.ok and not target.exists()
    # /tmp, /var/tmp and /dev/shm are the sandbox's own: writable there, nothing appears here
    r = run(
        "for d in ('/tmp', '/var/tmp', '/dev/shm'):\n    open(d + '/hybridflow-escape.txt', 'w').write('x')"
    )
    assert r.ok
    assert not any(Path(d, "hybridflow-escape.txt").exists() for d in ("/tmp", "/var/tmp", "/dev/shm"))


def test_hidden_run_directory_cannot_be_read(tmp_path):
    (tmp_path / "secret.txt").write_text("run data")
    r = run(f"print(open({str(tmp_path / 'secret.txt')!r}).read())", hide=[str(tmp_path)])
    assert not r.ok and "run data" not in r.stdout


def test_network_is_unreachable():
    r = run("import socket\nsocket.create_connection(('127.0.0.1', 80), timeout=1)\nprint('connected')")
    assert not r.ok and "connected" not in r.stdout


def test_huge_print_is_cut():
    r = run("print('x' * 50_000_000)")
    assert not r.ok and r.output_truncated and len(r.stdout) <= LIMITS.output_bytes


def test_disk_filling_stops_at_the_scratch_quota():
    r = run("f = open('big', 'wb')\nwhile True:\n    f.write(b'x' * 65536)")
    assert not r.ok


def test_environment_is_minimal():
    os.environ["HYBRIDFLOW_TEST_SECRET"] = "s3cret"
    try:
        r = run("import os\nprint(sorted(os.environ))")
    finally:
        del os.environ["HYBRIDFLOW_TEST_SECRET"]
    assert r.ok and "HYBRIDFLOW_TEST_SECRET" not in r.stdout


CODE_OK = "Here:\n```python\nn = int(input())\nprint(n * 2)\n```"
TESTS = {"inputs": ["2", "5", "7"], "outputs": ["4", "10", "14"]}


def test_code_scorer_fraction_and_all_or_nothing():
    assert compute_score("code", CODE_OK, TESTS)["score"] == 1.0
    half = "```python\nn = int(input())\nprint(4 if n == 2 else 0)\n```"
    assert compute_score("code", half, TESTS)["score"] == pytest.approx(1 / 3)
    assert compute_score("code", half, TESTS, code_options={"all_or_nothing": True})["score"] == 0.0
    asserts = "```python\ndef add(a, b):\n    return a + b\n```"
    assert (
        compute_score("code", asserts, {"asserts": ["assert add(1, 2) == 3", "assert add(2, 2) == 5"]})[
            "score"
        ]
        == 0.5
    )
    assert compute_score("code", "no code here", TESTS)["score"] == 0.0


@pytest.mark.parametrize(
    "cheat",
    [
        "import os\nos._exit(0)",
        "import sys\nsys.exit(0)",
        "raise SystemExit",
        "import atexit, os\natexit.register(lambda: os._exit(0))",
        "import sys\nsys.stdout.write('ok\\n')\nsys.exit(0)",
        "import sys\nprint(sys.stdin.read())\nprint(globals().get('_hf_marker'))\nsys.exit(0)",
    ],
)
def test_a_program_that_leaves_before_the_asserts_passes_none(cheat):
    """Reward hacking through the harness: exit status 0 before the tests ran is no pass."""
    response = f"```python\ndef add(a, b):\n    return 0\n{cheat}\n```"
    tests = {"asserts": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]}
    assert compute_score("code", response, tests)["score"] == 0.0
    honest = "```python\ndef add(a, b):\n    return a + b\nprint('hello')\n```"
    assert compute_score("code", honest, tests)["score"] == 1.0  # its own output does not matter


@pytest.mark.parametrize(
    "body",
    [
        "while True:\n    pass",
        "import os\nwhile True:\n    os.fork()",
        "x = bytearray(10 * 1024**3)",
        "import socket\nsocket.create_connection(('127.0.0.1', 80))",
        "print('x' * 50_000_000)",
    ],
)
def test_hostile_code_scores_zero(body):
    response = f"```python\n{body}\n```"
    limits = {"limits": SandboxLimits(wall_s=2.0, cpu_s=1, memory_mb=512)}
    assert (
        compute_score("code", response, {"inputs": ["1"], "outputs": ["2"]}, code_options=limits)["score"]
        == 0.0
    )


# as an ordinary user: test_sandbox_escapes.py::test_escapes_fail_as_an_ordinary_user
