"""Reward functions in the shapes TRL's documentation gives them (docs/source/grpo_trainer.md,
"Using a custom reward function": examples 1-6 and the quick start), called as TRL's GRPOTrainer
calls them. The inputs are ours; each expected value is worked out by hand."""

import asyncio
import math
import re

import pytest

from hybridflow.api.trl_rewards import RESPONSE_IDS_KEY, ROW_KEY, TRLRewards, keyword_callable
from hybridflow.errors import UserError


def score(funcs, rows, texts, *, weights=None, ids=None, step=0):
    """Our batched call: rows (dataset rows, one per completion) and completion texts."""
    rewards = TRLRewards([keyword_callable(f) for f in funcs], weights, "prompt")
    rewards.set_step(step, 10)
    infos = [{ROW_KEY: row, RESPONSE_IDS_KEY: i} for row, i in zip(rows, ids or [[0]] * len(rows))]
    return rewards(["s"] * len(rows), texts, [None] * len(rows), infos)


PLAIN = [{"prompt": "The sky is", "ground_truth": "2", "task": "math"},
         {"prompt": "The sun is", "ground_truth": "6", "task": "code"}]  # fmt: skip
CHAT = [{"prompt": [{"role": "user", "content": "What color is the sky?"}]}] * 2


def test_completion_ids_length():  # example 1
    def reward_func(completion_ids, **kwargs):
        return [float(len(ids)) for ids in completion_ids]

    out = score([reward_func], PLAIN, [" blue.", " in the sky."], ids=[[1, 2], [3, 4, 5]])
    assert [o["score"] for o in out] == [2.0, 3.0]


def test_character_length():  # example 1.1
    def reward_func(completions, **kwargs):
        return [float(len(completion)) for completion in completions]

    assert [o["score"] for o in score([reward_func], PLAIN, [" blue.", " in the sky."])] == [6.0, 12.0]


def test_conversational_completions_are_messages():  # example 2
    def format_reward_func(completions, **kwargs):
        pattern = r"^<think>.*?</think><answer>.*?</answer>$"
        contents = [completion[0]["content"] for completion in completions]
        return [1.0 if re.match(pattern, c) else 0.0 for c in contents]

    texts = ["<think>The sky is blue.</think><answer>blue</answer>", "The sky is blue."]
    assert [o["score"] for o in score([format_reward_func], CHAT, texts)] == [1.0, 0.0]


def test_a_dataset_column_by_name():  # example 3
    def reward_func(completions, ground_truth, **kwargs):
        matches = [re.search(r"\\boxed\{(.*?)\}", c) for c in completions]
        contents = [m.group(1) if m else "" for m in matches]
        return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]

    texts = [r" The solution is \boxed{2}.", r" The solution is \boxed{6}."]
    assert [o["score"] for o in score([reward_func], PLAIN, texts)] == [1.0, 1.0]
    assert [o["score"] for o in score([reward_func], PLAIN[::-1], texts)] == [0.0, 0.0]


def test_multi_task_functions_return_none_for_other_tasks():  # example 4
    def math_reward_func(prompts, completions, task, **kwargs):
        return [None if t != "math" else 1.0 if "4" in c else 0.0 for c, t in zip(completions, task)]

    def coding_reward_func(prompts, completions, task, **kwargs):
        return [None if t != "code" else 0.5 for t in task]

    out = score([math_reward_func, coding_reward_func], PLAIN, ["2 + 2 = 4", "print()"])
    assert [o["score"] for o in out] == [1.0, 0.5]  # each row scored by the function that knows it
    assert out[0]["math_reward_func"] == 1.0 and "coding_reward_func" not in out[0]


def test_every_function_none_is_nan():
    def only_math(completions, task, **kwargs):
        return [1.0 if t == "math" else None for t in task]

    out = score([only_math], PLAIN, ["a", "b"])
    assert out[0]["score"] == 1.0 and math.isnan(out[1]["score"])  # counted as an error, not a 0


def test_async_function():  # example 5
    async def async_reward_func(prompts, completions, **kwargs):
        await asyncio.sleep(0)
        return [1.0 if completion else 0.0 for completion in completions]

    assert [o["score"] for o in score([async_reward_func], PLAIN, ["x", ""])] == [1.0, 0.0]


def test_log_metric_and_log_extra():  # example 6
    def reward_func(completions, ground_truth, log_extra=None, log_metric=None, **kwargs):
        extracted = [re.search(r"\\boxed\{(.*?)\}", c) for c in completions]
        found = [m.group(1) if m else None for m in extracted]
        rewards = [1.0 if f == gt else 0.0 for f, gt in zip(found, ground_truth)]
        if log_extra:
            log_extra("golden_answer", list(ground_truth))
        if log_metric:
            log_metric("accuracy", sum(rewards) / len(rewards))
        return rewards

    out = score([reward_func], PLAIN, [r"\boxed{2}", r"\boxed{5}"])
    assert [o["score"] for o in out] == [1.0, 0.0] and out[0]["accuracy"] == 0.5


def test_quick_start_reward_len_and_weights():  # the quick start's reward, weighted with another
    def reward_len(completions, **kwargs):
        return [-abs(20 - len(completion)) for completion in completions]

    def has_blue(completions, **kwargs):
        return [1.0 if "blue" in c else 0.0 for c in completions]

    out = score([reward_len, has_blue], PLAIN, ["x" * 18, "blue"], weights=[1.0, 2.0])
    assert [o["score"] for o in out] == [-2.0, -16.0 + 2.0]


def test_trainer_state_shapes_by_progress():
    def warm(completions, trainer_state, **kwargs):
        return [trainer_state.global_step / trainer_state.max_steps] * len(completions)

    assert score([warm], PLAIN, ["a", "b"], step=5)[0]["score"] == 0.5


def test_prompts_are_the_datasets():
    def echo(prompts, completions, **kwargs):
        return [float(c.startswith(p[:3])) for p, c in zip(prompts, completions)]

    assert [o["score"] for o in score([echo], PLAIN, ["The end", "x"])] == [1.0, 0.0]


def test_the_tutorials_positional_lambda():
    out = score([lambda prompts, responses: [float(len(r)) for r in responses]], CHAT, ["ab", "abc"])
    assert [o["score"] for o in out] == [2.0, 3.0]  # the responses as text, even for chat rows


def test_wrong_shapes_are_named():
    with pytest.raises(UserError, match="verl's signature"):
        keyword_callable(lambda data_source, solution_str, ground_truth, extra_info: 0.0)
    with pytest.raises(UserError, match="reward_weights has 1 weights for 2"):
        TRLRewards([lambda completions, **k: [], lambda completions, **k: []], [1.0], "prompt")
    with pytest.raises(ValueError, match="returned 1 rewards for 2 completions"):
        score([lambda completions, **k: [1.0]], PLAIN, ["a", "b"])
