"""A Python tool for agents: the model's program runs in the reward sandbox (rewards/sandbox.py: its
own namespaces, seccomp, no network, limits on time, memory, processes and output), never in this
process. Programs run in worker threads of the tool's own pool, which is also its concurrency limit;
each ends at the sandbox's wall limit (its namespace killed), so no thread outlives its call."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import re

from hybridflow.agents.tools import ToolFailure
from hybridflow.rewards.sandbox import SandboxLimits, run_python

STDERR_TAIL_CHARS = 2000  # the end of a traceback says what went wrong
_FD_FILE = re.compile(r'File "/dev/fd/\d+"')


class SandboxedPython:
    """`python(code)` for `Tool`: the program's standard output, or its error.

    limits: the sandbox's (wall_s is the tool's deadline); hide: paths the program must not see (the
    run directory, the data files with their answers); max_concurrent: programs running at once."""

    def __init__(
        self,
        *,
        name: str = "python",
        limits: SandboxLimits | None = None,
        hide: tuple[str, ...] = (),
        max_concurrent: int = 4,
        description: str = "",
        argument: str = "code",
    ) -> None:
        self.limits = limits or SandboxLimits()
        self.hide = tuple(hide)
        self.pool = concurrent.futures.ThreadPoolExecutor(
            max(1, max_concurrent), thread_name_prefix="sandbox-tool"
        )
        self.function = self._function(name, description, argument)

    def _function(self, name: str, description: str, argument: str):
        """An async function named `name` whose one string parameter is `argument` (verl's
        `code_interpreter` takes `code`), with the docstring its schema is read from."""

        async def run(**kwargs) -> str:
            return await self.run(kwargs[argument])

        run.__name__ = run.__qualname__ = name
        run.__annotations__ = {argument: str, "return": str}
        run.__signature__ = _signature(argument)
        run.__doc__ = (
            description
            or "Run a Python program in a sandbox (no network, no files kept) and return what it prints."
        ) + f"\n\nArgs:\n    {argument}: a complete Python program; print the values you need\n"
        return run

    async def run(self, code: str) -> str:
        if not isinstance(code, str):
            raise ToolFailure(f"error: the program must be a string, got {type(code).__name__}")
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(
            self.pool, lambda: run_python(code, limits=self.limits, hide=self.hide)
        )
        if result.timed_out:
            raise ToolFailure(f"error: the program ran past {self.limits.wall_s:g} s and was stopped")
        if result.returncode != 0:
            # the program comes in on a file descriptor: name it as the model knows it
            tail = _FD_FILE.sub('File "<program>"', result.stderr[-STDERR_TAIL_CHARS:]).strip()
            tail = tail or f"exit status {result.returncode}"
            raise ToolFailure(f"error: {tail}")
        out = result.stdout
        if result.output_truncated:
            out += f"\n[output cut at {self.limits.output_bytes} bytes]"
        return out if out.strip() else "(the program printed nothing; print the values you need)"

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _signature(argument: str):
    import inspect

    return inspect.Signature(
        [inspect.Parameter(argument, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str)],
        return_annotation=str,
    )


def python_tool(
    *, wall_s: float, memory_mb: int = 512, hide: tuple[str, ...] = (), max_concurrent: int = 4, **kw
):
    """The built-in `python` tool: a program gets `wall_s` seconds (and as much CPU time)."""
    limits = dataclasses.replace(
        SandboxLimits(), wall_s=wall_s, cpu_s=max(1, int(wall_s)), memory_mb=memory_mb
    )
    return SandboxedPython(limits=limits, hide=hide, max_concurrent=max_concurrent, **kw)
