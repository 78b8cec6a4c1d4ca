"""Tools as typed Python functions: their OpenAI function schema comes from the signature and the
Google-style docstring (transformers' `get_json_schema`, as TRL's `tools=` does); a call runs with a
deadline and its output capped, and a failure comes back as text for the model, never as a crash."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import inspect
import json
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass


class DaemonThreads(concurrent.futures.Executor):
    """Up to `max_workers` daemon threads for the user's plain functions (tools, environments). A
    call that never returns is given up on at its deadline and cannot be stopped; in a daemon thread
    it also does not hold the interpreter at exit, as ThreadPoolExecutor's workers (joined at exit)
    would: a run that finished would hang there. As ThreadPoolExecutor's, the idle workers end when
    the pool is shut down or collected (they hold it only weakly)."""

    def __init__(self, max_workers: int, thread_name_prefix: str = "hybridflow") -> None:
        self._max, self._prefix = max_workers, thread_name_prefix
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False
        work = self._work
        self._ref = weakref.ref(self, lambda _: work.put(None))  # collected: the workers end

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("submit after shutdown")
            self._work.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max:
                thread = threading.Thread(
                    target=_work_until_stopped, args=(self._ref, self._work, self._idle),
                    name=f"{self._prefix}-{len(self._threads)}", daemon=True,
                )  # fmt: skip
                self._threads.append(thread)
                thread.start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Idle threads end; a thread stuck in a call ends with the process (it is a daemon)."""
        with self._lock:
            self._closed = True
            self._work.put(None)


def _work_until_stopped(pool_ref, work: queue.SimpleQueue, idle: threading.Semaphore) -> None:
    """A worker of DaemonThreads: calls until None arrives (passed on, so every worker ends)."""
    while True:
        item = work.get()
        if item is None:
            work.put(None)
            return
        future, fn, args, kwargs = item
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:  # SystemExit too: it is the call's outcome, not this thread's
                future.set_exception(e)
        del item, future, fn, args, kwargs
        if pool_ref() is None:
            work.put(None)
            return
        idle.release()


_DEFAULT_THREADS = DaemonThreads(32, "hybridflow-call")


class CalledExit(RuntimeError):
    """The user's function called exit(): the call failed, the run goes on."""


async def call_with_deadline(fn: Callable, *args, timeout_s: float, executor=None, **kwargs):
    """`fn(*args, **kwargs)` awaited (a coroutine function, cancelled at the deadline) or run in a
    thread of `executor` (DaemonThreads; a shared pool of them when None; given up on at the
    deadline: Python cannot stop a thread). The caller's context variables go with it. A function
    that calls exit() fails with CalledExit instead of ending the run."""
    name = getattr(fn, "__qualname__", repr(fn))
    if inspect.iscoroutinefunction(fn):

        async def guarded():  # asyncio re-raises a task's SystemExit out of the event loop itself
            try:
                return await fn(*args, **kwargs)
            except SystemExit as e:
                raise CalledExit(f"{name} called exit({e.code!r})") from None

        return await asyncio.wait_for(guarded(), timeout_s)
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    future = asyncio.get_running_loop().run_in_executor(executor or _DEFAULT_THREADS, call)
    try:
        return await asyncio.wait_for(future, timeout_s)
    except SystemExit as e:
        raise CalledExit(f"{name} called exit({e.code!r})") from None


_SAMPLE: contextvars.ContextVar = contextvars.ContextVar("hybridflow_agent_sample")
OUTPUT_KEEP = ("start", "end", "ends")


def current_sample():
    """The sample (hybridflow.batch.Prompt: messages, ground_truth, extra_info) of the episode whose
    tool call is running, for a tool that needs it (one that checks an answer, a per-task database).
    Each episode is its own asyncio task, so this is that episode's, in threads too."""
    try:
        return _SAMPLE.get()
    except LookupError:
        raise RuntimeError("current_sample() is only known inside an agent episode's tool call") from None


def set_current_sample(sample) -> None:
    _SAMPLE.set(sample)


def cut_output(text: str, max_chars: int, keep: str) -> str:
    """At most `max_chars` of `text` kept: its start, its end, or both ends (verl's
    tool_response_truncate_side left / right / middle); the cut is said where it was made."""
    if len(text) <= max_chars:
        return text
    cut = f"... [{len(text) - max_chars} characters cut] ..."
    if keep == "start":
        return text[:max_chars] + cut
    if keep == "end":
        return cut + text[len(text) - max_chars :]
    half = max_chars // 2
    return text[:half] + cut + text[len(text) - (max_chars - half) :]


@dataclass
class ToolResult:
    content: str
    ok: bool
    seconds: float


class ToolFailure(Exception):
    """Raised by a tool whose message is what the model should read, as it is."""


class Tool:
    """`Tool(fn, timeout_s=..., max_output_chars=...)`; `await tool(arguments_json)` -> ToolResult.

    `schema`: an OpenAI function schema to use instead of the one read from `fn` (a verl tool YAML's
    `tool_schema`); `fn` is then called with the arguments it names.

    An async function is cancelled at its deadline. A plain function runs in a worker thread: at its
    deadline the episode gets the timeout and goes on, but Python cannot stop the thread, so a tool
    that may hang or runs untrusted code belongs in the reward sandbox (a process it can kill)."""

    def __init__(
        self,
        fn: Callable,
        *,
        timeout_s: float = 30.0,
        max_output_chars: int = 4000,
        output_keep: str = "start",
        schema: dict | None = None,
    ) -> None:
        from transformers.utils import get_json_schema

        if output_keep not in OUTPUT_KEEP:
            raise ValueError(f"output_keep={output_keep!r}; choose one of {OUTPUT_KEEP}")
        self.fn, self.timeout_s, self.max_output_chars = fn, timeout_s, max_output_chars
        self.output_keep = output_keep
        # {"type": "function", "function": {name, description, parameters}}
        self.schema = schema or get_json_schema(fn)
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

    async def __call__(self, arguments: str | dict, *, executor=None) -> ToolResult:
        """`executor`: where a plain function runs (its loop's pool; asyncio's default when None)."""
        start = time.perf_counter()
        try:
            args = self._arguments(arguments)
            out = await call_with_deadline(self.fn, timeout_s=self.timeout_s, executor=executor, **args)
        except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11 on)
            return ToolResult(
                f"error: {self.name} timed out after {self.timeout_s:g} s", False, time.perf_counter() - start
            )
        except ToolFailure as e:  # a message written for the model
            return ToolResult(str(e), False, time.perf_counter() - start)
        except Exception as e:  # the model sees what went wrong and may try again
            return ToolResult(f"error: {type(e).__name__}: {e}", False, time.perf_counter() - start)
        text = out if isinstance(out, str) else json.dumps(out, default=str)
        text = cut_output(text, self.max_output_chars, self.output_keep)
        return ToolResult(text, True, time.perf_counter() - start)
