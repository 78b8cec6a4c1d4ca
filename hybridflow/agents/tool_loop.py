"""The built-in tool-calling agent loop: the model writes tool calls in its chat template's format
(Hermes `<tool_call>` for Qwen2.5/Qwen3, Mistral, Llama 3.1), the tools run, their results go back as
tool messages, until the model answers without a call or a limit is reached."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from hybridflow.agents.conversation import Conversation
from hybridflow.agents.tools import DaemonThreads, Tool, ToolResult, set_current_sample
from hybridflow.agents.trajectory import Trajectory
from hybridflow.batch import Prompt
from hybridflow.serve.tool_calls import parse_tool_calls, tool_format

MALFORMED_POLICIES = ("feedback", "end")
_FENCE = re.compile(r"```(?:json)?\s*(\{.*?\})\s*```", re.DOTALL)
MALFORMED_MESSAGE = (
    'error: the tool call could not be read; write <tool_call>{"name": ..., "arguments": {...}}</tool_call>'
)


def tools_system_text(schemas: list[dict]) -> str:
    """The tools and how to call them, for a chat template that does not render tools itself."""
    listed = "\n".join(json.dumps(s) for s in schemas)
    return (
        "You can call these tools (JSON schemas):\n<tools>\n" + listed + "\n</tools>\n"
        'To call one, write <tool_call>{"name": "TOOL", "arguments": {...}}</tool_call>; its result comes '
        "back in the next message. When you know the answer, reply without a tool call."
    )


def prompt_messages(sample: Prompt) -> list[dict]:
    """The sample's chat messages (a plain-text prompt becomes one user message)."""
    if isinstance(sample.messages, list):
        return [dict(m) for m in sample.messages]
    return [{"role": "user", "content": sample.messages if sample.messages is not None else sample.text}]


@dataclass
class ToolAgentLoop:
    """`await loop.run(sample, model)` -> the episode's segments.

    tools: functions (or Tool objects); max_turns: model calls per episode; max_tool_turns: turns of
    tool results per episode (0: no limit), the model's turn after the last one ends it; max_tool_calls:
    tool calls per episode and max_parallel_calls per turn (0: no limit; calls beyond either are
    answered with an error); max_response_tokens: tokens after the
    prompt, sampled and not, per episode; on_malformed: 'feedback' (an error message as the tool's
    result, the episode goes on) or 'end' (the episode ends, `malformed_penalty` as a step reward);
    max_concurrent_tools: tool calls running at once across every episode of the loop."""

    tokenizer: object
    tools: list[Callable | Tool]
    max_turns: int = 8
    max_tokens_per_turn: int = 0
    """Most tokens of one model call (0: all the episode has left)."""
    max_tool_calls: int = 16
    max_tool_turns: int = 0
    max_parallel_calls: int = 0
    max_response_tokens: int = 1024
    on_malformed: str = "feedback"
    malformed_penalty: float = 0.0
    tool_timeout_s: float = 30.0
    max_tool_output_chars: int = 4000
    tool_output_keep: str = "start"
    max_concurrent_tools: int = 64
    fenced_calls: bool = True
    """Also read a call written as a fenced JSON block ```json {"name": TOOL, "arguments": {...}}```
    naming one of the tools: what Qwen2.5-Coder-1.5B-Instruct writes instead of <tool_call>."""
    tool_format: str | None = None
    """'hermes', 'mistral' or 'llama3'; None: read from the tokenizer's chat template (one that renders
    no tools: Hermes, with the tools described in the system message)."""

    def __post_init__(self) -> None:
        if self.on_malformed not in MALFORMED_POLICIES:
            raise ValueError(f"on_malformed={self.on_malformed!r}; choose one of {MALFORMED_POLICIES}")
        self.tools = [t if isinstance(t, Tool) else Tool(t, timeout_s=self.tool_timeout_s,
                                                           max_output_chars=self.max_tool_output_chars,
                                                           output_keep=self.tool_output_keep)
                      for t in self.tools]  # fmt: skip
        self.by_name = {t.name: t for t in self.tools}
        rendered = tool_format(getattr(self.tokenizer, "chat_template", None))
        # a template that renders no tools (SmolLM2's, plain ChatML): they are described in the
        # system message, to be called in the Hermes format unless one is given
        self.describe_tools = rendered is None
        self.format = self.tool_format or rendered or "hermes"
        self._slots: tuple[object, asyncio.Semaphore] | None = None
        # plain-function tools run here: as many threads as calls may run at once (asyncio's default
        # pool has min(32, CPUs + 4)), so slow or hung calls do not queue the others behind them
        self._threads = DaemonThreads(self.max_concurrent_tools, thread_name_prefix="agent-tool")

    def _semaphore(self) -> asyncio.Semaphore:
        """One per event loop (a semaphore belongs to the loop it first waited in)."""
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots[0] is not loop:
            self._slots = (loop, asyncio.Semaphore(self.max_concurrent_tools))
        return self._slots[1]

    async def _call(self, call: dict) -> ToolResult:
        fn = call["function"]
        tool = self.by_name.get(fn["name"]) if isinstance(fn.get("name"), str) else None
        if tool is None:
            return ToolResult(
                f"error: no tool named {fn['name']!r}; tools: {', '.join(self.by_name)}", False, 0.0
            )
        async with self._semaphore():
            result = await tool(fn["arguments"], executor=self._threads)
        return result

    def _fenced(self, text: str) -> list[dict]:
        calls = []
        for block in _FENCE.findall(text):
            try:
                obj = json.loads(block)
            except json.JSONDecodeError:
                continue
            if (
                isinstance(obj, dict)
                and isinstance(obj.get("name"), str)
                and obj["name"] in self.by_name
                and isinstance(obj.get("arguments"), dict)
            ):
                calls.append(
                    {
                        "type": "function",
                        "function": {"name": obj["name"], "arguments": json.dumps(obj["arguments"])},
                    }
                )
        return calls

    async def _results(self, calls: list[dict], calls_left: int) -> list[ToolResult]:
        """One turn's calls run at once; those past the episode's or the turn's limit get an error."""
        allowed = min(max(calls_left, 0), self.max_parallel_calls or len(calls))
        results = list(await asyncio.gather(*(self._call(c) for c in calls[:allowed])))
        limit = (
            f"no more than {self.max_parallel_calls} tool calls in one turn"
            if allowed < calls_left
            else f"no more than {self.max_tool_calls} tool calls"
        )
        return results + [ToolResult(f"error: {limit}", False, 0.0)] * (len(calls) - allowed)

    def _messages(self, sample: Prompt) -> list[dict]:
        messages = prompt_messages(sample)
        if not self.describe_tools:
            return messages
        text = tools_system_text([t.schema for t in self.tools])
        if messages and messages[0]["role"] == "system":
            return [{"role": "system", "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
        return [{"role": "system", "content": text}, *messages]

    async def run(self, sample: Prompt, model) -> list[Trajectory]:
        set_current_sample(sample)  # this episode's task: what current_sample() gives its tools
        conv = Conversation(self.tokenizer, self._messages(sample), tools=[t.schema for t in self.tools])
        calls_left, finish = self.max_tool_calls, "max_turns"
        for turn_index in range(self.max_turns):
            turn = await conv.model_turn(model, self.max_response_tokens, self.max_tokens_per_turn)
            if turn is None:
                finish = "length"
                break
            text, completion = turn
            if completion.finish_reason != "stop":
                finish = "length"
                break
            content, calls = parse_tool_calls(text, self.format)
            if not calls and self.fenced_calls:
                calls = self._fenced(text)
            # a block that did not parse stays in the content
            malformed = self.format == "hermes" and "<tool_call>" in (content or "")
            if malformed and self.on_malformed == "end":
                conv.current.tool_failures += 1
                conv.current.turn_rewards.append(-self.malformed_penalty)
                finish = "malformed"
                break
            if not calls and not malformed:
                finish = "stop"
                break
            if self.max_tool_turns and turn_index >= self.max_tool_turns:
                finish = "max_turns"  # its tool turns are spent: this call is not answered
                break
            results = await self._results(calls, calls_left)
            calls_left -= len(calls)
            conv.current.tool_seconds += [r.seconds for r in results[: len(calls)]]
            if malformed:
                results.append(ToolResult(MALFORMED_MESSAGE, False, 0.0))
            conv.current.tool_calls += len(calls) + malformed
            conv.current.tool_failures += sum(not r.ok for r in results)
            if not conv.add_messages(
                [{"role": "tool", "content": r.content} for r in results],
                room=conv.room(self.max_response_tokens, model.max_context_tokens),
            ):
                finish = "length"
                break
        conv.current.finish_reason = finish
        return conv.segments
