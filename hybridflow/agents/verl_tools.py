"""verl's tool YAML (actor_rollout_ref.rollout.multi_turn.tool_config_path), read into our tools.

    tools:
      - class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool
        config: {default_timeout: 30, memory_limit_mb: 1024, num_workers: 10, ...}
        tool_schema: {type: function, function: {name, description, parameters}}

The schema is used as written (the model sees the same tool). Two of verl's classes have a meaning
here: SandboxFusionTool (its programs run in our code sandbox, not on a SandboxFusion server) and
Gsm8kTool (the answer is checked against the sample's ground truth). Any other class is verl code
(a BaseTool subclass) that cannot run without verl: refused, naming what to write instead."""

from __future__ import annotations

from pathlib import Path

import yaml

from hybridflow.agents.code_tool import python_tool
from hybridflow.agents.tools import Tool, current_sample
from hybridflow.errors import UserError
from hybridflow.rewards.scorers import gsm8k

SANDBOX_FUSION = "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
GSM8K = "verl.tools.gsm8k_tool.Gsm8kTool"


def _string_argument(schema: dict, where: str) -> str:
    """The one required string parameter a program or an answer comes in."""
    params = schema["function"].get("parameters", {})
    strings = [k for k, v in params.get("properties", {}).items() if v.get("type") == "string"]
    required = [k for k in params.get("required", []) if k in strings]
    if len(required) != 1:
        raise UserError(f"{where}: tool_schema must require exactly one string parameter, has {required}")
    return required[0]


def _answer_check(name: str, argument: str):
    async def check(**kwargs) -> str:
        """Score an answer against the episode's ground truth, as verl's Gsm8kTool does."""
        answer = str(kwargs[argument])
        response = answer if answer.startswith("#### ") else "#### " + answer
        reward = gsm8k(response, current_sample().ground_truth, method="flexible")["score"]
        return f"Current parsed answer={answer!r} reward={reward}"

    check.__name__ = name
    return check


def tools_from_verl_yaml(
    path: str,
    *,
    timeout_s: float,
    max_output_chars: int,
    output_keep: str,
    memory_mb: int,
    hide: tuple[str, ...],
    max_concurrent: int,
) -> list[Tool]:
    where = f"rollout.agent.tool_config {path}"
    try:
        spec = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise UserError(f"{where}: cannot read it: {e}") from e
    if not isinstance(spec, dict) or not isinstance(spec.get("tools"), list) or not spec["tools"]:
        raise UserError(f"{where}: expected `tools:` with a list of {{class_name, config, tool_schema}}")
    tools = []
    for i, entry in enumerate(spec["tools"]):
        at = f"{where}: tools[{i}]"
        schema = entry.get("tool_schema") if isinstance(entry, dict) else None
        if not isinstance(schema, dict) or "name" not in schema.get("function", {}):
            raise UserError(f"{at}: needs tool_schema with function.name")
        schema = {"type": "function", "function": dict(schema["function"])}
        name, cls = schema["function"]["name"], entry.get("class_name", "")
        config = entry.get("config") or {}
        if cls not in (SANDBOX_FUSION, GSM8K):
            raise UserError(
                f"{at}: class {cls!r} is verl code (a BaseTool) that runs only inside verl; write the tool as a "
                "typed Python function and name it in rollout.agent.tools=[FILE.py:FUNCTION]"
            )
        argument = _string_argument(schema, f"{at} ({name})")
        if cls == SANDBOX_FUSION:
            language = config.get("default_language", "python")
            if language != "python":
                raise UserError(f"{at}: default_language {language!r}: the code sandbox runs Python only")
            wall_s = float(config.get("default_timeout", timeout_s))
            sandbox = python_tool(
                wall_s=wall_s, memory_mb=int(config.get("memory_limit_mb", memory_mb)), hide=hide,
                max_concurrent=min(int(config.get("num_workers", max_concurrent)), max_concurrent),
                name=name, argument=argument,
            )  # fmt: skip
            fn, deadline = sandbox.function, max(timeout_s, wall_s)
        else:
            fn, deadline = _answer_check(name, argument), timeout_s
        tools.append(Tool(fn, timeout_s=deadline, max_output_chars=max_output_chars, output_keep=output_keep,
                          schema=schema))  # fmt: skip
    return tools
