"""Scripts in tests/cpu/scripts run with TRITON_INTERPRET=1: Triton's kernels on CPU tensors. The
variable must be set before triton is imported, hence a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def in_triton_interpreter(script: str, timeout: float = 300) -> str:
    """Run tests/cpu/scripts/`script` in the interpreter -> its stdout (asserting it exited 0)."""
    pytest.importorskip("triton")
    path = Path(__file__).parent / "scripts" / script
    env = os.environ | {"TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout
