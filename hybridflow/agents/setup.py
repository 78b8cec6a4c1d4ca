"""The agent loop a config asks for (`rollout.agent`), and running its episodes on a backend."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import sys

from hybridflow.agents.builtin import ENVIRONMENTS, TOOLS
from hybridflow.agents.code_tool import python_tool
from hybridflow.agents.environment import EnvAgentLoop
from hybridflow.agents.runner import AgentLoop, Episodes, run_episodes
from hybridflow.agents.tool_loop import ToolAgentLoop
from hybridflow.agents.verl_tools import tools_from_verl_yaml
from hybridflow.config.schema import AgentConfig
from hybridflow.errors import UserError
from hybridflow.rewards.loading import load_custom_function


def _load(spec: str, builtins: dict, key: str):
    if spec in builtins:
        return builtins[spec]
    path, sep, name = spec.rpartition(":")
    if not sep or not path.endswith(".py"):
        raise UserError(f"{key}: {spec!r} is neither a built-in ({', '.join(builtins)}) nor FILE.py:NAME")
    return load_custom_function(path, name, key=key, name_key=key)


def _tools(config: AgentConfig, hide: tuple[str, ...]) -> list:
    """The tools a config names: built-ins, FILE.py:FUNCTION, and those of a verl tool YAML."""
    sandboxes = config.code_tool_concurrency or os.cpu_count() or 1
    tools = []
    for spec in config.tools:
        if spec == "python":  # its limits come from the config
            tools.append(python_tool(wall_s=config.tool_timeout_s, memory_mb=config.code_tool_memory_mb,
                                     hide=hide, max_concurrent=sandboxes).function)  # fmt: skip
        else:
            tools.append(_load(spec, TOOLS, "rollout.agent.tools"))
    if config.tool_config:
        tools += tools_from_verl_yaml(
            config.tool_config, timeout_s=config.tool_timeout_s, max_output_chars=config.max_tool_output_chars,
            output_keep=config.tool_output_keep, memory_mb=config.code_tool_memory_mb, hide=hide,
            max_concurrent=sandboxes,
        )  # fmt: skip
    return tools


def agent_loop(
    config: AgentConfig, tokenizer, max_response_tokens: int, hide: tuple[str, ...] = ()
) -> AgentLoop | None:
    """`hide`: paths a sandboxed tool's programs must not see (the run directory, the data)."""
    if config.loop == "tools":
        try:
            return ToolAgentLoop(
                tokenizer, _tools(config, hide), max_turns=config.max_turns, max_tool_calls=config.max_tool_calls,
                max_tool_turns=config.max_tool_turns, max_parallel_calls=config.max_parallel_calls,
                max_tokens_per_turn=config.max_tokens_per_turn,
                max_response_tokens=max_response_tokens, on_malformed=config.on_malformed,
                malformed_penalty=config.malformed_penalty, tool_timeout_s=config.tool_timeout_s,
                max_tool_output_chars=config.max_tool_output_chars, tool_output_keep=config.tool_output_keep,
                max_concurrent_tools=config.max_concurrent_tools, tool_format=config.tool_format or None,
                fenced_calls=config.fenced_tool_calls,
            )  # fmt: skip
        except ValueError as e:  # no tool format in the template, a tool without a typed docstring
            raise UserError(f"rollout.agent: {e}") from e
    if config.loop == "environment":
        make_env = _load(config.environment, ENVIRONMENTS, "rollout.agent.environment")
        return EnvAgentLoop(tokenizer, make_env, max_turns=config.max_turns, max_tool_turns=config.max_tool_turns,
                            max_tokens_per_turn=config.max_tokens_per_turn,
                            max_response_tokens=max_response_tokens, step_timeout_s=config.step_timeout_s,
                            max_concurrent_steps=config.max_concurrent_tools)  # fmt: skip
    return None


def episodes_on(backend, loop: AgentLoop, prompts, params, first_group: int) -> Episodes:
    """Run the episodes on the native engine: through the policy server's driver when it serves
    (rollout.server), else on a driver of their own for this call."""
    from hybridflow.engine import Engine
    from hybridflow.engine.async_engine import AsyncEngine

    # a served backend's module is loaded already; importing it otherwise would pull in the HTTP stack
    served = sys.modules.get("hybridflow.serve.served_backend")
    if served is not None and isinstance(backend, served.ServedEngine):
        front = backend.server.front
        return backend.server.run(lambda: run_episodes(loop, prompts, front, params, first_group=first_group),
                                  served.CALL_TIMEOUT_S)  # fmt: skip
    if not isinstance(backend, Engine):
        raise UserError(
            f"rollout.agent runs on the native engine, not {type(backend).__name__}: set rollout.backend=native"
        )

    async def run() -> Episodes:
        front = AsyncEngine(backend)
        try:
            return await run_episodes(loop, prompts, front, params, first_group=first_group)
        finally:
            await front.aclose()

    try:
        asyncio.get_running_loop()
    except RuntimeError:  # the usual case: no event loop in this thread
        return asyncio.run(run())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # called from a running loop (a notebook)
        return pool.submit(asyncio.run, run()).result()
