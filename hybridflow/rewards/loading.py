"""Where reward functions come from: the built-in registry, or a file the user configured."""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from hybridflow.errors import UserError

RESPONSE_IDS_KEY = "response_ids"
"""What the Reward role adds to a row's extra_info when the function asks for the sampled token ids
(TRL's completion_ids)."""


def load_custom_function(
    path: str,
    name: str,
    *,
    key: str = "reward.custom_function_path",
    name_key: str = "reward.custom_function_name",
    kwargs: dict | None = None,
) -> Callable:
    """Import `name` from the Python file at `path` (only the path the user configured); errors name
    the config keys `key` (the file) and `name_key` (the name)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"{key}: file not found: {file}")
    spec = importlib.util.spec_from_file_location(f"hybridflow_custom_reward_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SystemExit as e:  # a module that exits at import would end the run without a word
        raise UserError(f"{key}: importing {file} called sys.exit({e.code!r})") from e
    except Exception as e:
        raise UserError(f"{key}: importing {file} failed: {type(e).__name__}: {e}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"{name_key}: {file} defines no function {name!r}")
    return functools.partial(fn, **kwargs) if kwargs else fn


_PROBE = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("hybridflow_reward_probe", sys.argv[1])
spec.loader.exec_module(importlib.util.module_from_spec(spec))
print("imported", flush=True)
"""


def check_import(path: str, *, timeout_s: float, key: str = "reward.custom_function_path") -> None:
    """Import the file once in a child process first: an import that hangs, exits (os._exit(0)
    would end this process with code 0, having trained nothing) or crashes the interpreter is one
    line here, before anything imports it in-process."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"{key}: file not found: {file}")
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, str(file)], capture_output=True, text=True,
                              timeout=timeout_s, cwd=file.parent)  # fmt: skip
    except subprocess.TimeoutExpired:
        raise UserError(
            f"{key}: importing {file} did not finish within {timeout_s:.0f} s (it hangs at import; raise reward.import_timeout_s if it is only slow)"
        ) from None
    if done.returncode == 0 and done.stdout.rstrip().endswith("imported"):
        return
    last = (done.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
    if done.returncode == 0:
        raise UserError(f"{key}: importing {file} ended the process (exit code 0) before the import finished")
    raise UserError(f"{key}: importing {file} failed (exit code {done.returncode}): {last}")


def builtin_function() -> Callable:
    from hybridflow.rewards.scorers import compute_score

    return compute_score
