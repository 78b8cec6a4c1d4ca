"""The reward service: process pool, timeouts, errors, batch and async functions, the Reward role."""

import functools
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hybridflow.batch import Prompt, Rollouts
from hybridflow.config.schema import RewardConfig
from hybridflow.errors import UserError
from hybridflow.models import byte_tokenizer
from hybridflow.rewards.executor import RewardExecutor
from hybridflow.rewards.loading import load_custom_function
from hybridflow.roles.reward import Reward

CUSTOM = """
import asyncio, math, time

def flaky(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "raise":
        raise ValueError("bad")
    if solution_str == "hang":
        time.sleep(60)
    if solution_str == "nan":
        return math.nan
    if solution_str == "text":
        return "not a number"
    if solution_str == "exit":
        raise SystemExit(3)
    if solution_str == "huge":
        return 1e39
    if solution_str == "deaf":  # stuck where no alarm reaches (as code in C is)
        import signal
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        time.sleep(60)
    return {"score": float(solution_str == ground_truth), "pred": solution_str, "length": len(solution_str)}

def batched(data_sources, solution_strs, ground_truths, extra_infos):
    return [float(s == g) for s, g in zip(solution_strs, ground_truths)]

async def async_score(data_source, solution_str, ground_truth, extra_info=None):
    await asyncio.sleep(0)
    return float(solution_str == ground_truth)
"""


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "custom.py"
    path.write_text(CUSTOM)
    return path


def items(*texts, truth="ok"):
    return [("x", t, truth, {}) for t in texts]


@pytest.mark.parametrize("workers", [0, 2])
def test_errors_timeouts_and_non_numbers_score_zero(reward_file, workers):
    executor = RewardExecutor(
        functools.partial(load_custom_function, str(reward_file), "flaky"), num_workers=workers, timeout_s=1.0
    )
    try:
        start = time.monotonic()
        out = executor.score(items("ok", "raise", "hang", "nan", "text", "no", "exit", "huge"))
        elapsed = time.monotonic() - start
    finally:
        executor.close()
    assert [o.score for o in out] == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert [o.error for o in out] == [False, True, False, True, True, False, True, True]
    assert [o.timeout for o in out] == [False, False, True, False, False, False, False, False]
    assert (
        "SystemExit: 3" in out[6].message and "reward.max_abs=1e+06" in out[7].message
    )  # sys.exit: its error
    assert out[0].pred == "ok" and out[0].extras == {"length": 2.0}
    assert elapsed < 10  # the hanging function did not hold the run for its 60 s


def test_stuck_and_dead_workers_are_replaced_and_no_batch_waits_forever(reward_file):
    """The pool that hung three times in a day: a worker past the hard deadline (deaf to its alarm)
    was killed with Pool.terminate(), which waited forever on a lock idle workers held; a killed idle
    worker hung it too; so did SIGTERM to the whole group. Each worker now has its own pipe."""
    import signal as signals

    executor = RewardExecutor(
        functools.partial(load_custom_function, str(reward_file), "flaky"), num_workers=2, timeout_s=0.5
    )
    try:
        for round_ in range(4):  # a stuck worker every round, beside idle ones
            start = time.monotonic()
            out = executor.score(items("ok", "deaf", "no", "ok"))
            assert [o.score for o in out] == [1.0, 0.0, 0.0, 1.0], round_
            assert [o.timeout for o in out] == [False, True, False, False], round_
            assert time.monotonic() - start < 30, round_
        executor.pool.wait_ready()  # the replacements have started (a starting one cannot ignore signals yet)
        processes = [w.process for w in executor.pool.workers]
        pids = [p.pid for p in processes]
        os.kill(pids[0], signals.SIGKILL)  # an idle worker killed
        for pid in pids[1:]:
            os.kill(pid, signals.SIGTERM)  # what Slurm / systemd send the whole group: ignored
        time.sleep(0.5)
        assert [o.score for o in executor.score(items("ok", "ok", "no"))] == [1.0, 1.0, 0.0]
        assert executor.pool.workers[1].process.pid == pids[1]  # the SIGTERMed worker lives on
    finally:
        executor.close()
    assert not any(p.is_alive() for p in processes)  # close() leaves no worker behind


def test_scoring_workers_run_no_ahead_of_the_runs_ray_workers(reward_file):
    """run_at_niceness: every thread of the live workers, and a replacement from its start, at the
    Ray workers' niceness (15, a cluster's default) at least; never lowered."""
    executor = RewardExecutor(
        functools.partial(load_custom_function, str(reward_file), "flaky"), num_workers=2, timeout_s=0.5
    )

    def niceness() -> list[int]:
        return [
            os.getpriority(os.PRIO_PROCESS, int(tid))
            for w in executor.pool.workers
            for tid in os.listdir(f"/proc/{w.process.pid}/task")
        ]

    try:
        executor.pool.wait_ready()
        assert set(niceness()) == {os.nice(0)}
        executor.run_at_niceness(15)
        assert set(niceness()) == {15}
        executor.run_at_niceness(5)  # a raise only
        out = executor.score(items("ok", "deaf", "ok"))  # the deaf one's worker is killed and replaced
        assert [o.timeout for o in out] == [False, True, False]
        executor.pool.wait_ready()
        assert set(niceness()) == {15}
    finally:
        executor.close()


def test_workers_that_cannot_start_stop_with_the_cause(reward_file, tmp_path):
    """A module that imports here but kills the worker that loads it (exit at import in a child):
    the first batch stops with that cause instead of waiting forever."""
    (tmp_path / "exits_in_workers.py").write_text(
        "import os\n"
        "if os.environ.get('SCORING_PARENT') != str(os.getpid()):\n"
        "    os._exit(3)\n"
        "def flaky(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 1.0\n"
    )
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import functools, os\n"
        "os.environ['SCORING_PARENT'] = str(os.getpid())\n"
        "from hybridflow.rewards.executor import RewardExecutor\n"
        "from hybridflow.rewards.loading import load_custom_function\n"
        f"loader = functools.partial(load_custom_function, {str(tmp_path / 'exits_in_workers.py')!r}, 'flaky')\n"
        "RewardExecutor(loader, num_workers=1, timeout_s=1.0, start_timeout_s=10).score([('x', 'ok', 'ok', {})])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0
    assert "the reward workers did not start (worker 0 exited with code 3 while starting)" in done.stderr
    assert time.monotonic() - start < 30  # the worker's death is seen at once, not at the start deadline


def test_batch_and_async_functions(reward_file):
    for name in ("batched", "async_score"):
        executor = RewardExecutor(
            functools.partial(load_custom_function, str(reward_file), name), num_workers=2, timeout_s=2.0
        )
        try:
            assert [o.score for o in executor.score(items("ok", "no", "ok"))] == [1.0, 0.0, 1.0]
        finally:
            executor.close()


def test_scoring_runs_while_the_caller_goes_on(reward_file):
    executor = RewardExecutor(
        functools.partial(load_custom_function, str(reward_file), "flaky"), num_workers=2, timeout_s=1.0
    )
    try:
        future = executor.submit(items("hang"))
        assert not future.done()  # submit returned at once
        assert future.result()[0].timeout
        assert executor.score(items("ok"))[0].score == 1.0  # the pool was rebuilt and still works
    finally:
        executor.close()


def test_custom_reward_loading_errors(tmp_path):
    with pytest.raises(UserError, match="file not found"):
        load_custom_function(str(tmp_path / "nope.py"), "f")
    (tmp_path / "r.py").write_text("x = 1\n")
    with pytest.raises(UserError, match="defines no function 'f'"):
        load_custom_function(str(tmp_path / "r.py"), "f")
    (tmp_path / "bad.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(UserError, match="importing .*bad.py failed: RuntimeError: boom"):
        load_custom_function(str(tmp_path / "bad.py"), "f")
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(0)\n")
    with pytest.raises(UserError, match=r"importing .*exits.py called sys.exit\(0\)"):
        load_custom_function(str(tmp_path / "exits.py"), "f")


def _rollouts(tok, texts, truth="4", source="arithmetic"):
    prompt = Prompt(index=0, token_ids=[1], data_source=source, ground_truth=truth, messages="2 + 2 = ?")
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    return Rollouts(
        [[1]] * len(ids),
        ids,
        [[0.0] * len(i) for i in ids],
        ["stop"] * len(ids),
        [0] * len(ids),
        [prompt] * len(ids),
    )


def test_reward_role_scores_builtins_with_metrics():
    tok = byte_tokenizer()
    reward = Reward(tok, RewardConfig(num_workers=2), max_response_tokens=16)
    try:
        result = reward.score(_rollouts(tok, ["4", "5", "2 + 2 = 4", "4 or 5"]))
    finally:
        reward.close()
    assert result.raw_scores.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert result.preds[:3] == ["4", "5", "4"]
    assert result.metrics["reward/errors"] == 0 and result.metrics["reward/timeouts"] == 0
    assert "reward/latency_p95_ms" in result.metrics and "timing_s/reward" in result.metrics


def test_reward_role_scores_only_what_the_policy_sampled():
    """A multi-turn response whose tool output holds the answer: the scorer sees the policy's own
    tokens (mask 1) only, so the tool's "4" earns nothing and the policy's own "4" does."""
    tok = byte_tokenizer()
    reward = Reward(tok, RewardConfig(num_workers=1), max_response_tokens=32)
    tool = tok.encode(" 4", add_special_tokens=False)
    tails = [tok.encode(" done", add_special_tokens=False), tok.encode(" it is 4", add_special_tokens=False)]
    rollouts = _rollouts(tok, ["call", "call"])
    rollouts.response_ids = [r + tool + tail for r, tail in zip(rollouts.response_ids, tails)]
    rollouts.loss_masks = [
        [1] * (len(r) - len(tool) - len(tail)) + [0] * len(tool) + [1] * len(tail)
        for r, tail in zip(rollouts.response_ids, tails)
    ]
    try:
        result = reward.score(rollouts)
        unmasked = reward.score(replace(rollouts, loss_masks=None))  # "call 4 done" would score
    finally:
        reward.close()
    assert result.raw_scores.tolist() == [0.0, 1.0]
    assert unmasked.raw_scores.tolist() == [1.0, 1.0]


def test_reward_model_is_weighted_in(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from hybridflow.models.tiny import tiny_config

    config = tiny_config("llama", num_labels=1)
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path / "rm")
    byte_tokenizer().save_pretrained(tmp_path / "rm")
    tok = byte_tokenizer()
    reward = Reward(
        tok,
        RewardConfig(num_workers=0, model_path=str(tmp_path / "rm"), model_weight=0.5, rule_weight=2.0),
        max_response_tokens=16,
    )
    rollouts = _rollouts(tok, ["4", "5"])
    result = reward.score(rollouts)
    model_scores = reward.model.score(["2 + 2 = ?"] * 2, ["4", "5"])
    torch.testing.assert_close(result.scores, torch.tensor([2.0, 0.0]) + 0.5 * model_scores)
    # the reward model's own chat template wraps prompt and response
    text = reward.model._text("2 + 2 = ?", "4")
    assert text == "<|im_start|>user\n2 + 2 = ?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"

    alone = Reward(
        tok,
        RewardConfig(num_workers=0, model_path=str(tmp_path / "rm"), rule_weight=0.0),
        max_response_tokens=16,
    )
    alone.check_sources({"no-scorer-for-this"})  # a reward model alone needs no rule scorer
    rollouts = _rollouts(tok, ["4", "5"], source="no-scorer-for-this")
    torch.testing.assert_close(alone.score(rollouts).scores, model_scores)


def test_reward_model_packed_scores_equal_transformers_padded(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from hybridflow.models.native import NativeScoreModel
    from hybridflow.models.tiny import tiny_config
    from hybridflow.rewards.reward_model import RewardModel

    torch.manual_seed(1)
    AutoModelForSequenceClassification.from_config(tiny_config("qwen3", num_labels=1)).save_pretrained(
        tmp_path
    )
    byte_tokenizer().save_pretrained(tmp_path)
    packed, padded = RewardModel(str(tmp_path)), RewardModel(str(tmp_path), impl="hf")
    assert isinstance(packed.model, NativeScoreModel) and not isinstance(padded.model, NativeScoreModel)
    prompts, responses = (
        ["2 + 2 = ?", "a longer question, 3 * 7 = ?", "x"],
        ["4", "21, because 3 * 7 = 21", ""],
    )
    scores = packed.score(prompts, responses)
    assert scores.std() > 0
    torch.testing.assert_close(scores, padded.score(prompts, responses), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "body, message",
    [
        ("import os\nos._exit(0)\n", "ended the process \\(exit code 0\\) before the import finished"),
        ("import time\ntime.sleep(600)\n", "did not finish within 2 s"),
        ("raise SystemExit(3)\n", "failed \\(exit code 3\\)"),
    ],
)
def test_a_reward_file_that_exits_or_hangs_at_import_is_one_line(tmp_path, body, message):
    """Imported first in a child process, with a deadline: os._exit(0) at import would otherwise end
    the run with exit code 0 having trained nothing, and a hang sit outside every watchdog."""
    from hybridflow.errors import UserError
    from hybridflow.rewards.loading import check_import

    (tmp_path / "reward.py").write_text(body)
    with pytest.raises(UserError, match="reward.custom_function_path: importing .*reward.py " + message):
        check_import(str(tmp_path / "reward.py"), timeout_s=2)
    (tmp_path / "fine.py").write_text("def compute_score(*a):\n    return 1.0\n")
    check_import(str(tmp_path / "fine.py"), timeout_s=30)
