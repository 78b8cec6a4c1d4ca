"""Tools as typed Python functions: their OpenAI function schema comes from the signature and the
Google-style docstring (transformers' `get_json_schema`, as TRL's `tools=` does); a call runs with a
deadline and its output capped, and a failure comes back as text for the model, never as a crash."""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import Callable
from dataclasses import dataclass


async def call_with_deadline(fn: Callable, *args, timeout_s: float, **kwargs):
    """`fn(*args, **kwargs)` awaited (a coroutine function, cancelled at the deadline) or run in a
    worker thread (given up on at the deadline: Python cannot stop a thread)."""
    if inspect.iscoroutinefunction(fn):
        return await asyncio.wait_for(fn(*args, **kwargs), timeout_s)
    return await asyncio.wait_for(asyncio.to_thread(fn, *args, **kwargs), timeout_s)


@dataclass
class ToolResult:
    content: str
    ok: bool
    seconds: float


class Tool:
    """`Tool(fn, timeout_s=..., max_output_chars=...)`; `await tool(arguments_json)` -> ToolResult.

    An async function is cancelled at its deadline. A plain function runs in a worker thread: at its
    deadline the episode gets the timeout and goes on, but Python cannot stop the thread, so a tool
    that may hang or runs untrusted code belongs in the reward sandbox (a process it can kill)."""

    def __init__(self, fn: Callable, *, timeout_s: float = 30.0, max_output_chars: int = 4000) -> None:
        from transformers.utils import get_json_schema

        self.fn, self.timeout_s, self.max_output_chars = fn, timeout_s, max_output_chars
        self.schema = get_json_schema(fn)  # {"type": "function", "function": {name, description, parameters}}
        self.name = self.schema["function"]["name"]
        params = self.schema["function"]["parameters"]
        self._known = set(params.get("properties", {}))
        self._required = set(params.get("required", []))

    def _arguments(self, arguments: str | dict) -> dict:
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
        if not isinstance(args, dict):
            raise ValueError(f"arguments must be a JSON object, got {type(args).__name__}")
        unknown, missing = set(args) - self._known, self._required - set(args)
        if unknown or missing:
            raise ValueError(
                f"{self.name} takes {sorted(self._known)}"
                + (f"; unknown {sorted(unknown)}" if unknown else "")
                + (f"; missing {sorted(missing)}" if missing else "")
            )
        return args

    async def __call__(self, arguments: str | dict) -> ToolResult:
        start = time.perf_counter()
        try:
            args = self._arguments(arguments)
            out = await call_with_deadline(self.fn, timeout_s=self.timeout_s, **args)
        except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11 on)
            return ToolResult(
                f"error: {self.name} timed out after {self.timeout_s:g} s", False, time.perf_counter() - start
            )
        except Exception as e:  # the model sees what went wrong and may try again
            return ToolResult(f"error: {type(e).__name__}: {e}", False, time.perf_counter() - start)
        text = out if isinstance(out, str) else json.dumps(out, default=str)
        if len(text) > self.max_output_chars:
            text = (
                text[: self.max_output_chars]
                + f"... [{len(text) - self.max_output_chars} more characters cut]"
            )
        return ToolResult(text, True, time.perf_counter() - start)
