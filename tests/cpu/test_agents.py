"""Agent loops (issue #29): tools from typed functions, the exact token prefix across turns (and a
history-rewriting template caught), malformed / hanging / crashing tool calls, environments, and many
episodes at once on the engine with loss masks."""

import asyncio
import time
from pathlib import Path

import pytest
import torch
from agent_helpers import STRIPS_THINKING, Scripted, _prompt, _tokenizer, add, crash, slow  # noqa: E402

from hybridflow.agents import (
    Completion,
    Conversation,
    EngineModel,
    EnvAgentLoop,
    Tool,
    ToolAgentLoop,
    run_episodes,
)
from hybridflow.batch import Prompt
from hybridflow.engine import Engine, EngineConfig
from hybridflow.engine.async_engine import AsyncEngine
from hybridflow.models import byte_tokenizer, tiny_model
from hybridflow.models.native import from_hf_model
from hybridflow.rollout.sampling import SamplingParams


def test_tools_from_typed_functions_and_their_failures():
    schema = Tool(add).schema["function"]
    assert schema["name"] == "add" and schema["description"] == "Add two integers."
    assert schema["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first number"}

    async def calls():
        return [
            await Tool(add)('{"a": 2, "b": 3}'),
            await Tool(add)('{"a": 2}'),
            await Tool(add)("not json"),
            await Tool(crash)({"x": 1}),
            await Tool(slow, timeout_s=0.2)({"seconds": 30}),
            await Tool(lambda_text, max_output_chars=10)({"n": 100}),
        ]

    start = time.perf_counter()
    ok, missing, garbled, crashed, hung, long = asyncio.run(calls())
    assert time.perf_counter() - start < 5  # the hanging tool was given up on at its deadline
    assert (ok.content, ok.ok) == ("5", True)
    assert not missing.ok and "missing ['b']" in missing.content
    assert not garbled.ok and garbled.content.startswith("error: JSONDecodeError")
    assert not crashed.ok and crashed.content == "error: RuntimeError: the tool broke"
    assert not hung.ok and hung.content == "error: slow timed out after 0.2 s"
    assert long.content == "x" * 10 + "... [90 characters cut] ..."


def lambda_text(n: int) -> str:
    """n x's.

    Args:
        n: how many
    """
    return "x" * n


def test_each_turn_extends_the_exact_prefix_and_only_sampled_tokens_are_trained():
    tok = _tokenizer()
    model = Scripted(
        tok, ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>', "It is 5."]
    )
    loop = ToolAgentLoop(tok, [add])
    (episode,) = asyncio.run(loop.run(_prompt(), model))
    assert episode.finish_reason == "stop" and episode.turns == 2 and episode.tool_calls == 1
    # the second call saw exactly: the first prompt, the sampled turn, the template's tool turn
    whole = episode.prompt_ids + episode.response_ids
    assert model.seen[1] == whole[: len(model.seen[1])]
    messages = [
        {"role": "user", "content": "What is 2 + 3?"},
        {
            "role": "assistant",
            "content": '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
        },
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "It is 5."},
    ]
    rendered = tok.apply_chat_template(messages, tools=[Tool(add).schema], tokenize=False)
    assert tok.decode(whole, skip_special_tokens=False) == rendered.rstrip(
        "\n"
    )  # the last "\n" is not sampled
    sampled = [t for t, m in zip(episode.response_ids, episode.loss_mask) if m]
    observed = [t for t, m in zip(episode.response_ids, episode.loss_mask) if not m]
    # the model's turns with the end-of-turn tokens it sampled
    assert (
        tok.decode(sampled, skip_special_tokens=False)
        == messages[1]["content"] + "<|im_end|>It is 5.<|im_end|>"
    )
    assert tok.decode(observed, skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert episode.logprobs == [-0.5 if m else 0.0 for m in episode.loss_mask]


def test_a_template_that_rewrites_history_starts_a_new_segment():
    tok = _tokenizer(STRIPS_THINKING)
    conv = Conversation(tok, [{"role": "user", "content": "hi"}], tools=None)
    ids = tok.encode("<think>hmm</think>Hello<|im_end|>", add_special_tokens=False)
    conv.add_model_turn(Completion(ids, [-1.0] * len(ids), "stop", 3))
    conv.add_messages([{"role": "user", "content": "again"}])
    assert conv.rewrites == 1 and len(conv.segments) == 2
    first, second = conv.segments
    assert (
        first.response_ids == ids
        and first.loss_mask == [1] * len(ids)
        and first.weight_versions == [3] * len(ids)
    )
    # the new segment's prompt is what the template now shows: the thinking is gone
    assert tok.decode(second.prompt_ids, skip_special_tokens=False).endswith(
        "<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    )
    assert conv.tokens == second.prompt_ids and second.response_ids == []
    # a template that keeps the history: one segment
    kept = Conversation(_tokenizer(), [{"role": "user", "content": "hi"}])
    kept.add_model_turn(Completion(ids, [-1.0] * len(ids), "stop", 3))
    kept.add_messages([{"role": "user", "content": "again"}])
    assert kept.rewrites == 0 and len(kept.segments) == 1


def test_a_template_without_tools_gets_them_in_the_system_message():
    tok = byte_tokenizer()  # plain ChatML: renders no tools
    model = Scripted(tok, ['<tool_call>{"name": "add", "arguments": {"a": 20, "b": 22}}</tool_call>', "42"])
    (episode,) = asyncio.run(ToolAgentLoop(tok, [add]).run(_prompt(), model))
    first = tok.decode(model.seen[0], skip_special_tokens=False)
    assert first.startswith("<|im_start|>system\nYou can call these tools") and '"name": "add"' in first
    assert episode.tool_calls == 1 and episode.tool_failures == 0
    assert "<|im_start|>tool\n42<|im_end|>" in tok.decode(model.seen[1], skip_special_tokens=False)


@pytest.mark.parametrize("policy", ["feedback", "end"])
def test_malformed_tool_calls_are_fed_back_or_end_the_episode(policy):
    tok = _tokenizer()
    turns = ["<tool_call>{not json}</tool_call>", "Sorry: 5."]
    loop = ToolAgentLoop(tok, [add], on_malformed=policy, malformed_penalty=0.5)
    model = Scripted(tok, turns)
    (episode,) = asyncio.run(loop.run(_prompt(), model))
    assert episode.tool_failures == 1
    if policy == "end":
        assert episode.finish_reason == "malformed" and episode.turn_rewards == [-0.5] and episode.turns == 1
    else:
        assert episode.finish_reason == "stop" and episode.turns == 2
        assert "error: the tool call could not be read" in tok.decode(
            model.seen[1], skip_special_tokens=False
        )


def test_limits_end_episodes_and_errors_reach_the_model():
    tok = _tokenizer()
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'
    three = call + call + call
    loop = ToolAgentLoop(tok, [add, crash], max_turns=3, max_tool_calls=4)
    model = Scripted(
        tok, [three, '<tool_call>{"name": "crash", "arguments": {"x": 1}}</tool_call>' + call, call]
    )
    (episode,) = asyncio.run(loop.run(_prompt(), model))
    assert episode.finish_reason == "max_turns" and episode.turns == 3 and episode.tool_calls == 6
    seen = tok.decode(model.seen[2], skip_special_tokens=False)
    assert "error: RuntimeError: the tool broke" in seen and "error: no more than 4 tool calls" in seen
    assert episode.tool_failures == 2 + 1  # the crash, the call past the limit, then the 3rd turn's: not run
    short = ToolAgentLoop(tok, [add], max_response_tokens=40)
    (cut,) = asyncio.run(short.run(_prompt(), Scripted(tok, [call * 3, "x"])))
    assert cut.finish_reason == "length" and len(cut.response_ids) <= 40


class GuessTheNumber:
    """Higher / lower; reward 1 for the right guess."""

    def reset(self, sample):
        self.secret, self.guesses = int(sample.ground_truth), 0
        return "Guess a number from 1 to 9."

    def step(self, action):
        self.guesses += 1
        guess = int(action.strip()[-1]) if action.strip()[-1:].isdigit() else -1
        if guess == self.secret:
            return None, 1.0, True
        return ("higher" if guess < self.secret else "lower"), 0.0, False


def test_environment_turns_rewards_and_a_failing_environment():
    tok = _tokenizer()
    loop = EnvAgentLoop(tok, GuessTheNumber, max_turns=5)
    (episode,) = asyncio.run(loop.run(_prompt(), Scripted(tok, ["3", "7", "5"])))
    assert episode.finish_reason == "stop" and episode.turns == 3 and episode.turn_rewards == [0.0, 0.0, 1.0]
    assert episode.total_reward() == 1.0
    text = tok.decode(episode.response_ids, skip_special_tokens=False)
    assert "higher" in text and "lower" in text

    class Broken(GuessTheNumber):
        def step(self, action):
            raise ValueError("env bug")

    (broken,) = asyncio.run(EnvAgentLoop(tok, Broken).run(_prompt(), Scripted(tok, ["3"])))
    assert broken.finish_reason == "error" and broken.total_reward() == 0.0


def test_many_episodes_at_once_on_the_engine_with_a_slow_tool():
    """64 episodes (8 prompts x 8) with a tool that takes 0.3 s: they run concurrently (the whole is
    far less than 64 x the tool's time), every sampled token is the engine's, and the masks and
    log-probs line up; the same seed gives the same episodes."""
    tok = _tokenizer()
    model = from_hf_model(tiny_model("qwen2", seed=1))
    engine = Engine(
        model, eos_token_ids=[tok.eos_token_id], config=EngineConfig(page_size=4, max_context_tokens=512)
    )

    async def wait(seconds: float) -> str:
        """Wait.

        Args:
            seconds: how long
        """
        await asyncio.sleep(0.3)
        return "ok"

    class CallsOnce(ToolAgentLoop):
        """Calls the tool once by itself (a random model would not), then lets the model answer."""

        async def run(self, sample, model):
            async def generate(token_ids, *, max_tokens, stop_token_ids=()):
                if not hasattr(model, "called"):
                    model.called = True
                    ids = tok.encode('<tool_call>{"name": "wait", "arguments": {"seconds": 1}}</tool_call>',
                                     add_special_tokens=False) + [tok.eos_token_id]  # fmt: skip
                    return Completion(ids, [0.0] * len(ids), "stop", 0)
                return await real(token_ids, max_tokens=max_tokens)

            real, model.generate = model.generate, generate
            return await super().run(sample, model)

    loop = CallsOnce(tok, [wait], max_turns=2, max_response_tokens=200)
    prompts = [Prompt(i, [], "agent", messages=[{"role": "user", "content": f"q{i}"}]) for i in range(8)]
    params = SamplingParams(n=8, temperature=1.0, seed=7)

    async def both():
        front = AsyncEngine(engine)
        try:
            start = time.perf_counter()
            a = await run_episodes(loop, prompts, front, params)
            seconds = time.perf_counter() - start
            b = await run_episodes(loop, prompts, front, params)
        finally:
            await front.aclose()
        return a, b, seconds

    a, b, seconds = asyncio.run(both())
    assert seconds < 64 * 0.3 / 2
    r = a.rollouts
    assert len(r) == 64 and r.group_ids == [i // 8 for i in range(64)]
    assert a.metrics["agent/episodes"] == 64 and a.metrics["agent/tool_calls_mean"] == 1.0
    for ids, mask, lps in zip(r.response_ids, r.loss_masks, r.response_logprobs):
        assert len(ids) == len(mask) == len(lps) <= 200
        assert sum(mask) > 70  # the scripted call, then the engine's own turn
        assert all(lp == 0.0 for lp, m in zip(lps, mask) if not m)
    assert r.response_ids == b.rollouts.response_ids  # reproducible beside other episodes
    assert len({tuple(x) for x in r.response_ids}) > 8
    assert all(s is None for s in a.scores)  # no outcome from the loop: the reward role scores them


def test_engine_model_records_each_tokens_weight_version():
    tok = _tokenizer()
    model = from_hf_model(tiny_model("qwen2", seed=1))
    engine = Engine(
        model, eos_token_ids=[tok.eos_token_id], config=EngineConfig(page_size=4, max_context_tokens=128)
    )

    async def go():
        front = AsyncEngine(engine)
        try:
            handle = EngineModel(front, SamplingParams(temperature=1.0, seed=3))
            first = await handle.generate([5, 6, 7], max_tokens=6)
            await front.between_steps(lambda e: e.update_weights([]))
            second = await handle.generate([5, 6, 7], max_tokens=6)
        finally:
            await front.aclose()
        return first, second

    first, second = asyncio.run(go())
    assert (first.weight_version, second.weight_version) == (0, 1)
    assert (first.weight_versions, second.weight_versions) == (
        [0] * len(first.token_ids),
        [1] * len(second.token_ids),
    )
    assert len(first.token_ids) == len(first.logprobs) <= 6
    assert torch.tensor(first.logprobs).le(0).all()


def test_training_on_environment_and_tool_episodes(tmp_path):
    """`rollout.agent` end to end on a tiny model: guess_number episodes (the environment's rewards
    are the scores; its answers are in the responses, masked out) and calculator episodes (a
    template with tools), two GRPO steps each, with the agent/* metrics."""
    import json

    from agent_helpers import write_guess_game

    from hybridflow.config import load_config
    from hybridflow.controller.trainer import RLTrainer

    write_guess_game(tmp_path)
    base = [
        f"model.path={tmp_path / 'model'}",
        f"data.train_files=[{tmp_path / 'rows.jsonl'}]",
        "data.max_response_tokens=48",
        "data.prompts_per_step=4",
        "rollout.samples_per_prompt=4",
        "rollout.agent.max_turns=3",
        "rollout.agent.max_tokens_per_turn=8",
        "actor.compute_dtype=float32",
        "reward.num_workers=0",
        "trainer.logger=[jsonl]",
        "trainer.total_training_steps=2",
        "trainer.val_before_train=false",
    ]
    for name, extra in (
        ("env", ["rollout.agent.loop=environment", "rollout.agent.environment=guess_number"]),
        ("tools", ["rollout.agent.loop=tools", "rollout.agent.tools=[calculator]",
                   "reward.custom_function_path=" + str(tmp_path / "reward.py")]),
    ):  # fmt: skip
        (tmp_path / "reward.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                            "    return float(ground_truth in solution_str)\n")  # fmt: skip
        run_dir = tmp_path / name
        config = load_config(None, [*base, *extra, f"trainer.run_dir={run_dir}"])
        RLTrainer(config).fit()
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steps = [m for m in metrics if "agent/episodes" in m]
        assert len(steps) == 2 and all(m["agent/episodes"] == 16 for m in steps), name
        assert all(m["agent/turns_mean"] >= 1 for m in steps)
        if name == "env":  # a random model rarely guesses right in 3 turns: the turns go on
            assert any(m["agent/turns_mean"] > 1 for m in steps)
            assert all(0.0 <= m["critic/score/mean"] <= 1.0 for m in steps)


@pytest.mark.parametrize(
    "outcome",
    ["1.0 points", float("nan"), 1e39, float("inf"), "exit", "async-exit"],
)
def test_an_environment_that_misbehaves_ends_its_own_episode(outcome):
    """A reward that is not a finite number, or exit() inside step (plain or async), is that
    episode's error (agent/finish/error), not the run's end or a NaN blamed on the learning rate."""
    import sys

    tok = _tokenizer()

    class Hostile(GuessTheNumber):
        def step(self, action):
            if outcome == "exit":
                sys.exit(0)
            return "again", outcome, False

    class AsyncHostile(GuessTheNumber):
        async def step(self, action):
            sys.exit(0)

    env = AsyncHostile if outcome == "async-exit" else Hostile
    (episode,) = asyncio.run(EnvAgentLoop(tok, env, max_turns=3).run(_prompt(), Scripted(tok, ["3", "4"])))
    assert episode.finish_reason == "error" and episode.turn_rewards == [] and episode.turns == 1


def test_a_fenced_call_whose_name_is_not_a_string_is_not_a_call():
    tok = _tokenizer()
    turns = ['```json\n{"name": ["add"], "arguments": {"a": 1, "b": 2}}\n```', "3"]
    (episode,) = asyncio.run(ToolAgentLoop(tok, [add]).run(_prompt(), Scripted(tok, turns)))
    assert episode.finish_reason == "stop" and episode.tool_calls == 0


def test_a_hung_tool_or_environment_does_not_hold_the_process_at_exit(tmp_path):
    """A plain-function tool and an environment step that never return: their episodes time out,
    and the process ends when its work is done (ThreadPoolExecutor's workers would be joined at
    exit, for ever)."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "hung.py"
    script.write_text(
        textwrap.dedent(f'''
        import asyncio, sys, threading
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from agent_helpers import HungEnvironment, Scripted, _prompt, _tokenizer
        from hybridflow.agents import EnvAgentLoop, ToolAgentLoop

        def never(x: int) -> int:
            """Never returns.

            Args:
                x: anything
            """
            threading.Event().wait()

        tok = _tokenizer()
        call = '<tool_call>{{"name": "never", "arguments": {{"x": 1}}}}</tool_call>'
        loop = ToolAgentLoop(tok, [never], tool_timeout_s=0.5)
        (tool,) = asyncio.run(loop.run(_prompt(), Scripted(tok, [call, "done"])))
        env = EnvAgentLoop(tok, HungEnvironment, step_timeout_s=0.5)
        (stuck,) = asyncio.run(env.run(_prompt(), Scripted(tok, ["3"])))
        print("episodes", tool.tool_failures, stuck.finish_reason, flush=True)
    ''')
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "episodes 1 error" in done.stdout


def test_speculation_in_agent_episodes_samples_what_a_plain_run_samples(tmp_path):
    """`rollout.speculative` with `rollout.agent` (guess_number episodes: an earlier turn's text is in
    the next turn's prompt, where drafts come from): two GRPO steps give the plain run's rewards,
    turns and lengths, with drafts checked."""
    import json

    from agent_helpers import write_guess_game

    from hybridflow.config import load_config
    from hybridflow.controller.trainer import RLTrainer

    write_guess_game(tmp_path)
    base = [
        f"model.path={tmp_path / 'model'}", f"data.train_files=[{tmp_path / 'rows.jsonl'}]",
        "data.max_response_tokens=48", "data.prompts_per_step=4", "rollout.samples_per_prompt=4",
        "rollout.agent.max_turns=3", "rollout.agent.max_tokens_per_turn=8", "actor.compute_dtype=float32",
        "reward.num_workers=0", "trainer.logger=[jsonl]", "trainer.total_training_steps=2",
        "trainer.val_before_train=false", "rollout.agent.loop=environment",
        "rollout.agent.environment=guess_number",
    ]  # fmt: skip
    speculative = [
        "rollout.speculative.num_speculative_tokens=4",
        "rollout.speculative.max_batch_sequences=128",
        "rollout.speculative.adaptive=false",
        "rollout.speculative.prompt_lookup_min=1",  # (a random model's text repeats few longer n-grams)
    ]
    runs = {}
    for name, extra in (("plain", []), ("speculative", speculative)):
        run_dir = tmp_path / name
        RLTrainer(load_config(None, [*base, *extra, f"trainer.run_dir={run_dir}"])).fit()
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        runs[name] = [m for m in metrics if "agent/episodes" in m]
    assert len(runs["plain"]) == len(runs["speculative"]) == 2
    for plain, spec in zip(runs["plain"], runs["speculative"]):
        for key in ("critic/score/mean", "agent/turns_mean", "response_length/mean"):
            assert spec[key] == plain[key], key
    assert sum(m.get("rollout/speculative_drafted", 0) for m in runs["speculative"]) > 0
