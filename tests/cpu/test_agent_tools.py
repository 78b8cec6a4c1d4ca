"""Tools that run safely (issue #29, part 4) and verl's multi-turn material as its users bring it:
the python tool in the code sandbox (output, errors, deadline, no network, hidden files, its
concurrency limit), per-turn and per-episode limits, output cut as verl cuts it, verl's tool YAML
and its multi-turn command resolved as written.

tests/cpu/data/verl_multiturn/ holds verl's own example files (examples/sglang_multiturn/config at
verl b178a3cd, Apache-2.0), unchanged."""

import asyncio
import time
from pathlib import Path

import pytest
from agent_helpers import Scripted, _prompt, _tokenizer, add

from hybridflow.agents import Tool, ToolAgentLoop
from hybridflow.agents.code_tool import python_tool
from hybridflow.agents.tools import cut_output
from hybridflow.agents.verl_tools import tools_from_verl_yaml
from hybridflow.batch import Prompt
from hybridflow.config.loader import resolve_config
from hybridflow.errors import UserError

VERL = Path(__file__).parent / "data" / "verl_multiturn"


def _run(coro):
    return asyncio.run(coro)


def test_python_tool_runs_programs_in_the_sandbox(tmp_path):
    secret = tmp_path / "answers.jsonl"
    secret.write_text('{"answer": 42}\n')
    tool = Tool(python_tool(wall_s=2.0, hide=(str(secret),)).function, timeout_s=2.0)
    assert tool.schema["function"]["parameters"]["required"] == ["code"]

    ok = _run(tool({"code": "print(123456789 * 987654321)"}))
    assert ok.ok and ok.content.strip() == str(123456789 * 987654321)
    error = _run(tool({"code": "x = 1\n1 / 0"}))
    assert not error.ok and error.content.startswith("error: Traceback")
    assert 'File "<program>", line 2' in error.content and error.content.endswith(
        "ZeroDivisionError: division by zero"
    )
    start = time.monotonic()
    hang = _run(tool({"code": "while True:\n    pass"}))
    assert not hang.ok and "timed out" in hang.content and time.monotonic() - start < 4
    net = _run(tool({"code": "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)"}))
    assert not net.ok and "Error" in net.content
    hidden = _run(tool({"code": f"print(open({str(secret)!r}).read())"}))
    assert "42" not in hidden.content
    quiet = _run(tool({"code": "x = 2"}))
    assert quiet.ok and "printed nothing" in quiet.content


def test_python_tool_concurrency_is_its_pools_size():
    sandbox = python_tool(wall_s=5.0, max_concurrent=2)
    tool = Tool(sandbox.function, timeout_s=10.0)
    program = "import time, os\nt = time.time()\ntime.sleep(0.6)\nprint(t, time.time())"

    async def four():
        return await asyncio.gather(*(tool({"code": program}) for _ in range(4)))

    results = _run(four())
    spans = sorted(tuple(map(float, r.content.split())) for r in results)
    # at any moment at most two programs sleep: at each start, at most two spans hold it (a span may
    # overlap two others one after the other: a slow sandbox start staggers them)
    for start, _ in spans:
        assert sum(1 for a, b in spans if a <= start < b) <= 2, spans
    assert all(r.ok for r in results)


def test_output_is_cut_keeping_the_start_the_end_or_both_ends():
    text = "0123456789" * 3
    assert cut_output(text, 8, "start") == "01234567... [22 characters cut] ..."
    assert cut_output(text, 8, "end") == "... [22 characters cut] ...23456789"
    assert cut_output(text, 8, "ends") == "0123... [22 characters cut] ...6789"
    assert cut_output("short", 8, "ends") == "short"


def test_parallel_calls_and_tool_turns_are_limited():
    tok = _tokenizer()
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool_call>'
    loop = ToolAgentLoop(tok, [add], max_parallel_calls=2, max_turns=5)
    model = Scripted(tok, [call * 3, "4"])
    (episode,) = _run(loop.run(_prompt(), model))
    seen = tok.decode(model.seen[1], skip_special_tokens=False)
    assert seen.count("\n4\n") == 2 and "error: no more than 2 tool calls in one turn" in seen
    assert episode.finish_reason == "stop" and episode.tool_failures == 1
    # verl's max_user_turns: after one tool turn, the next turn is the last, its calls unanswered
    once = ToolAgentLoop(tok, [add], max_tool_turns=1, max_turns=5)
    model = Scripted(tok, [call, call, "4"])
    (episode,) = _run(once.run(_prompt(), model))
    assert episode.turns == 2 and episode.finish_reason == "max_turns" and len(model.seen) == 2


def test_verls_sandbox_fusion_tool_yaml_runs_in_our_sandbox():
    (tool,) = tools_from_verl_yaml(
        str(VERL / "sandbox_fusion_tool_config.yaml"), timeout_s=30.0, max_output_chars=256,
        output_keep="ends", memory_mb=512, hide=(), max_concurrent=2,
    )  # fmt: skip
    assert tool.schema["function"]["name"] == "code_interpreter"
    assert tool.schema["function"]["description"] == "A tool for executing code."
    assert tool.timeout_s == 30.0 and tool.output_keep == "ends"
    result = _run(tool('{"code": "print(sum(range(101)))"}'))
    assert result.ok and result.content.strip() == "5050"
    long = _run(tool('{"code": "print(\'a\' * 1000)"}'))
    assert len(long.content) < 300 and "characters cut" in long.content


def test_verls_gsm8k_tool_checks_the_episodes_own_answer():
    (tool,) = tools_from_verl_yaml(
        str(VERL / "gsm8k_tool_config.yaml"), timeout_s=5.0, max_output_chars=256, output_keep="ends",
        memory_mb=512, hide=(), max_concurrent=2,
    )  # fmt: skip
    tok = _tokenizer()
    loop = ToolAgentLoop(tok, [tool])

    def episode(truth, answer):
        sample = Prompt(0, [], "gsm8k", ground_truth=truth, messages=[{"role": "user", "content": "q"}])
        call = (
            f'<tool_call>{{"name": "calc_gsm8k_reward", "arguments": {{"answer": "{answer}"}}}}</tool_call>'
        )
        model = Scripted(tok, [call, "done"])
        _run(loop.run(sample, model))
        return tok.decode(model.seen[1], skip_special_tokens=False)

    assert "Current parsed answer='72' reward=1.0" in episode("72", "72")
    assert "Current parsed answer='71' reward=0.0" in episode("72", "71")


def test_verl_tool_classes_that_are_verl_code_are_refused():
    with pytest.raises(
        UserError, match=r"tools\[0\]: class 'verl.tools.search_tool.SearchTool' is verl code"
    ):
        tools_from_verl_yaml(
            str(VERL / "search_tool_config.yaml"), timeout_s=5.0, max_output_chars=256, output_keep="ends",
            memory_mb=512, hide=(), max_concurrent=2,
        )  # fmt: skip


def test_verls_multi_turn_command_resolves_as_written():
    """examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn.sh's keys, with its config file."""
    argv = [
        f"--config-path={VERL}", "--config-name=gsm8k_multiturn_grpo",
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.name=sglang",
        "actor_rollout_ref.rollout.multi_stage_wake_up=True", "actor_rollout_ref.rollout.n=16",
        "actor_rollout_ref.rollout.over_sample_rate=0.1", "actor_rollout_ref.rollout.mode=async",
        "data.train_files=/d/train.parquet", "data.val_files=/d/test.parquet",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={VERL}/gsm8k_tool_config.yaml",
    ]  # fmt: skip
    from hybridflow.cli import _recipe_and_overrides, build_parser

    args = build_parser().parse_args(["config", "show", *argv])
    recipe, overrides = _recipe_and_overrides(args)
    resolved = resolve_config(recipe, overrides)
    agent, c = resolved.config.rollout.agent, resolved.config
    assert (agent.loop, agent.tool_config, agent.max_turns) == ("tools", f"{VERL}/gsm8k_tool_config.yaml", 5)
    # verl's defaults for what the files leave unsaid
    assert (agent.max_parallel_calls, agent.max_tool_output_chars, agent.tool_output_keep, agent.tool_format) == (
        1, 256, "ends", "hermes",
    )  # fmt: skip
    assert (c.rollout.backend, c.rollout.samples_per_prompt, c.data.prompts_per_step) == ("native", 16, 256)
    assert (c.data.max_prompt_tokens, c.data.max_response_tokens) == (1024, 1024)
    notes = "\n".join(resolved.notes)
    assert "SGLang is not used" in notes and "over_sample_rate" in notes
    with pytest.raises(UserError, match="interaction_config_path: verl interactions are verl code"):
        resolve_config(
            recipe, [*overrides, "actor_rollout_ref.rollout.multi_turn.interaction_config_path=x.yaml"]
        )
    with pytest.raises(UserError, match="multi_turn.enable=True\\) needs rollout.agent.tools"):
        resolve_config(recipe, ["data.train_files=/d/t.parquet"])


def test_a_call_in_a_fenced_json_block_is_read_when_it_names_a_tool():
    """Qwen2.5-Coder-1.5B-Instruct writes its calls this way, never in <tool_call> (seen on the H200)."""
    tok = _tokenizer()
    fenced = '```json\n{\n  "name": "add",\n  "arguments": {"a": 2, "b": 3}\n}\n```'
    model = Scripted(tok, [fenced, "#### 5"])
    (episode,) = _run(ToolAgentLoop(tok, [add]).run(_prompt(), model))
    assert episode.tool_calls == 1 and "<tool_response>\n5\n</tool_response>" in tok.decode(model.seen[1])
    other = '```json\n{"name": "multiply", "arguments": {"a": 2}}\n```'  # no such tool: plain text
    (episode,) = _run(ToolAgentLoop(tok, [add]).run(_prompt(), Scripted(tok, [other])))
    assert episode.tool_calls == 0 and episode.finish_reason == "stop"
    (episode,) = _run(ToolAgentLoop(tok, [add], fenced_calls=False).run(_prompt(), Scripted(tok, [fenced])))
    assert episode.tool_calls == 0


def nap(seconds: float) -> str:
    """Block this thread for a while, then say whose episode it was.

    Args:
        seconds: how long to block
    """
    from hybridflow.agents.tools import current_sample

    time.sleep(seconds)
    return current_sample().ground_truth


def test_blocking_tools_run_at_once_up_to_the_limit_and_see_their_episode():
    """asyncio's default pool has min(32, CPUs + 4) threads (6 here): 16 blocking calls would take three
    rounds. The loop's own pool runs max_concurrent_tools of them at once."""
    tok = _tokenizer()
    loop = ToolAgentLoop(tok, [nap], max_concurrent_tools=16)
    call = '<tool_call>{"name": "nap", "arguments": {"seconds": 0.5}}</tool_call>'
    samples = [Prompt(i, [], "agent", ground_truth=f"episode-{i}", messages=[{"role": "user", "content": "q"}])
               for i in range(16)]  # fmt: skip
    models = [Scripted(tok, [call, "done"]) for _ in samples]

    async def all_episodes():
        return await asyncio.gather(*(loop.run(s, m) for s, m in zip(samples, models)))

    start = time.monotonic()
    episodes = _run(all_episodes())
    assert time.monotonic() - start < 1.3  # one round of 0.5 s, not three
    assert all(e.tool_failures == 0 for (e,) in episodes)
    for i, model in enumerate(models):  # each call saw its own episode's sample
        assert f"episode-{i}\n" in tok.decode(model.seen[1])


def test_verls_search_config_with_its_sglang_era_format_resolves():
    """examples/sglang_multiturn/config/search_multiturn_grpo.yaml says `format: qwen` (SGLang's Qwen 2.5
    parser): the same <tool_call> blocks as hermes."""
    resolved = resolve_config(
        str(VERL / "search_multiturn_grpo.yaml"),
        [f"actor_rollout_ref.rollout.multi_turn.tool_config_path={VERL}/sandbox_fusion_tool_config.yaml"],
    )
    agent = resolved.config.rollout.agent
    assert (agent.tool_format, agent.max_turns, agent.loop) == ("hermes", 2, "tools")
    assert resolved.config.data.shuffle is False
