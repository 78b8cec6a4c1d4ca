"""Scorer tables, guards, format/code scoring, and property tests that no input breaks a scorer."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridflow.rewards import compute_score
from hybridflow.rewards.scorers import SCORERS, UnknownDataSource


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("so the total is 72.\n#### 72", "72", 1.0),
        ("#### -5", "-5", 1.0),
        ("#### 1,234", "1234", 1.0),  # thousands separator stripped
        ("#### $18", "18", 0.0),  # verl's strict pattern has no '$' after '####'
        ("#### 18 dollars", "18", 1.0),
        ("#### 18.", "18", 0.0),  # verl compares strings: '18.' is not '18'
        ("#### 18.00", "18", 0.0),
        ("#### 18.5", "18.5", 1.0),
        ("#### 1,234.", "1234.", 1.0),  # commas go, the period stays
        ("####18", "18", 0.0),  # verl's pattern needs the space
        ("The answer is 72", "72", 0.0),  # strict needs ####
        ("#### 71", "72", 0.0),
        ("#### 7\n#### 72", "72", 1.0),  # the last one counts
        ("", "72", 0.0),
        ("x" * 400 + "#### 72", "72", 1.0),
        ("#### 72" + "x" * 400, "72", 0.0),  # outside the last 300 characters, as in verl
    ],
)
def test_gsm8k_table(response, truth, expected):
    assert compute_score("openai/gsm8k", response, truth)["score"] == expected
    assert compute_score("gsm8k", response, truth)["score"] == expected


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("the total is 18.", "18", 0.0),  # verl's flexible regex keeps the period, no cleaning
        ("the total is 18", "18", 1.0),
        ("1,000 apples", "1000", 0.0),  # nor are commas removed
        ("7 then 18 .", "18", 1.0),  # '.' alone is skipped
        ("no number", "18", 0.0),
    ],
)
def test_gsm8k_flexible_is_verls(response, truth, expected):
    from hybridflow.rewards.scorers import gsm8k

    assert gsm8k(response, truth, method="flexible")["score"] == expected


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("#### 18.", "18", 1.0),
        ("#### 18.00", "18", 1.0),
        ("#### $18", "18", 1.0),
        ("The answer is 1,000.", "1000", 1.0),
        ("#### 17", "18", 0.0),
    ],
)
def test_gsm8k_lenient_compares_numbers(response, truth, expected):
    assert compute_score("gsm8k_lenient", response, truth)["score"] == expected


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("#### 18.00", "18", 1.0),
        ("The total is $1,080.", "1080", 1.0),  # no '####': the last number
        ("So she has \\boxed{\\frac{36}{2}} apples.", "18", 1.0),  # math-verify: 36/2 = 18
        ("Half of 36 is 18 and she gives 2 away, so 16 remain. #### 16", "16", 1.0),
        ("#### 17", "18", 0.0),
        ("I cannot tell.", "18", 0.0),
    ],
)
def test_gsm8k_math_verify_checks_the_answer_whatever_its_format(response, truth, expected):
    assert compute_score("gsm8k_math_verify", response, truth)["score"] == expected
    if "####" not in response:  # verl's strict extraction gives these nothing
        assert compute_score("openai/gsm8k", response, truth)["score"] == 0.0


def test_builtin_scorers_report_acc_without_partial_credit():
    assert compute_score("openai/gsm8k", "#### 17", "18")["acc"] == 0.0
    assert compute_score("openai/gsm8k", "#### 18", "18")["acc"] == 1.0
    wrong = compute_score("countdown", "<answer>1 + 2</answer>", {"numbers": [1, 2], "target": 4})
    assert (wrong["score"], wrong["acc"]) == (0.1, 0.0)  # format credit, but not correct


def test_gsm8k_guards_are_one_switch_away():
    assert compute_score("openai/gsm8k", "#### 5, 6", "5")["score"] == 1.0  # verl's behaviour by default
    assert compute_score("openai/gsm8k", "#### 5, 6", "5", guards=True)["score"] == 0.0


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        (r"so $x = \boxed{\frac{1}{2}}$", "0.5", 1.0),
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"\boxed{1/2}", r"\frac12", 1.0),
        (r"\boxed{\dfrac{3}{4}}", r"\frac{3}{4}", 1.0),
        (r"\boxed{[1, 2]}", "[1,2]", 1.0),  # interval
        (r"\boxed{\{2, 1\}}", r"\{1,2\}", 1.0),  # set
        (r"\boxed{5 \text{ cm}}", "5", 1.0),  # units stripped
        (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}", 1.0),  # nested braces
        (r"first \boxed{3} then \boxed{4}", "4", 1.0),  # the last box counts
        (r"first \boxed{4} then \boxed{3}", "4", 0.0),
        (r"\fbox{7}", "7", 1.0),
        (r"\boxed{-3}", "-3", 1.0),
        ("the answer is 4", "4", 0.0),  # no box
        (r"\boxed{}", "4", 0.0),
        (r"\boxed{3 \text{ or } 4}", "4", 0.0),  # hedging guard
        (r"\boxed{3, 4}", "4", 0.0),
        (r"\boxed{(3, 4)}", "(3,4)", 1.0),  # a tuple answer is not hedging
    ],
)
def test_math_table(response, truth, expected):
    assert compute_score("math", response, truth)["score"] == expected


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("12 + 7 = 19", "19", 1.0),
        ("The answer is 19.", "19", 1.0),
        ("#### 19", "19", 1.0),
        ("-3", "-3", 1.0),
        ("19 or 20", "19", 0.0),  # several candidates
        ("#### 19 20", "19", 0.0),
        ("no idea", "19", 0.0),
        ("1,000", "1000", 1.0),
        # from the issue (the demo report's samples)
        ("9 + 2 equals 11", "11", 1.0),
        ("0 + 4 = ?", "4", 0.0),  # restates the question: no answer
        # SmolLM2-135M-Instruct's own outputs on the demo's held-out prompts (greedy and T=1)
        ("9 + 8 = 17", "17", 1.0),
        ("3 + 7 equals 10.", "10", 1.0),
        ("Well, 6 + 6 equals 12.", "12", 1.0),
        ("7 + 6 equals 13. Empathizers saw Levonite", "13", 1.0),
        ("The answer is 13. When you add 7 to 6,", "13", 1.0),
        ("The answer is 1.", "1", 1.0),
        ("The answer is 11.", "12", 0.0),
        ("1. 5 - 1 = 6", "4", 0.0),
        ("1. 5 - 1 = 4", "4", 1.0),  # the list marker is not the answer
        ("6 - 3 = 1\n\nThis is a classic example of a", "3", 0.0),
        ("6 - 3 = 3\n\nThis is a classic example of a", "3", 1.0),
        ("2 - 4 is equal to 5.", "-2", 0.0),
        ("It's 7, not 7.", "7", 1.0),  # its first clause answers 7
        ("Answer: 6 or 7", "6", 0.0),  # a hedge
        ("13 in total", "13", 1.0),
        ("0\n\nIn mathematics, this is a classic example of the identity known as", "0", 1.0),
        ("Not quite... [PRINCETON JAMES CABREZ", "9", 0.0),
    ],
)
def test_arithmetic_table(response, truth, expected):
    assert compute_score("arithmetic", response, truth)["score"] == expected


@pytest.mark.parametrize(
    "response, expected",
    [
        ("<answer> (7 + 61) + 1 </answer>", 1.0),
        ("<think>x</think><answer>61 + 7 + 1</answer>", 1.0),
        ("<answer>61 + 7 + 1 = 69</answer>", 1.0),
        ("<answer>61 + 8</answer>", 0.1),  # wrong numbers: format score only
        ("<answer>61 * 7 + 1</answer>", 0.1),  # right numbers, wrong value
        ("<answer>__import__('os').system('x')</answer>", 0.0),  # never evaluated
        ("<answer>61 + 7 + 1 + 1</answer>", 0.1),
        ("61 + 7 + 1", 0.0),
    ],
)
def test_countdown_table(response, expected):
    assert compute_score("countdown", response, {"target": 69, "numbers": [1, 61, 7]})["score"] == expected


def test_format_reward_composes_with_correctness():
    out = compute_score("arithmetic", "<think>2+2</think> 4", "4", format_weight=0.5)
    assert out["score"] == 1.5 and out["format"] == 1.0
    assert compute_score("arithmetic", "4", "4", format_weight=0.5)["score"] == 1.0
    assert (
        compute_score("arithmetic", "ANSWER: 4", "4", format_weight=1.0, format_pattern=r"ANSWER: ")["score"]
        == 2.0
    )


def test_length_guard():
    long = "7 " * 15_000 + "#### 4"
    assert compute_score("arithmetic", long, "4")["score"] == 0.0
    assert compute_score("arithmetic", long, "4", guards=False)["score"] == 1.0


def test_unknown_source_lists_the_known_ones():
    with pytest.raises(
        UnknownDataSource, match="no reward scorer for data_source 'nope'; built-in sources: openai/gsm8k"
    ):
        compute_score("nope", "x", "1")


TRUTHS = {
    "openai/gsm8k": "12",
    "arithmetic": "12",
    "math": r"\frac{1}{2}",
    "countdown": {"target": 5, "numbers": [2, 3]},
}


@settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=st.text(max_size=400)
    | st.from_regex(r"(\\boxed\{[{}0-9a-z\\ ,]*\}|#### [-0-9.,$ ]*|<answer>[-+*/() 0-9]*</answer>){1,3}")
)
def test_no_input_makes_a_scorer_raise(text):
    for source, truth in TRUTHS.items():
        out = compute_score(source, text, truth)
        assert 0.0 <= out["score"] <= 1.0


def test_every_source_named_in_the_issue_is_registered():
    for source in ("openai/gsm8k", "gsm8k", "math", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval",
                   "HuggingFaceH4/MATH-500", "arithmetic", "countdown", "code"):  # fmt: skip
        assert source in SCORERS


def test_validation_reports_further_numbers_of_the_reward_as_val_aux():
    """A reward that returns a strict acc and a lenient check: val-core carries the acc, val-aux the
    lenient share (verl's naming), per data source and averaged over prompts."""
    import torch

    from hybridflow.batch import Prompt, Rollouts
    from hybridflow.controller.validation import validate
    from hybridflow.roles.reward import RewardResult

    prompts = [Prompt(0, [1], "openai/gsm8k"), Prompt(1, [2], "openai/gsm8k"), Prompt(2, [3], "math")]
    rollouts = Rollouts(
        prompt_ids=[[1], [2], [3]], response_ids=[[4], [5], [6]], response_logprobs=[[0.0]] * 3,
        finish_reasons=["stop"] * 3, group_ids=[0, 1, 2], prompts=prompts,
    )  # fmt: skip

    class Scored:
        def score(self, _rollouts):
            zeros = torch.zeros(3)
            return RewardResult(
                zeros, zeros, [None] * 3, accs=torch.tensor([0.0, 1.0, 0.0]), acc_given=True,
                extras={"lenient": torch.tensor([1.0, 1.0, 0.0])},
            )  # fmt: skip

    metrics, _ = validate(lambda p, params: rollouts, Scored(), prompts, type("P", (), {"n": 1})())
    assert metrics["val-core/openai/gsm8k/acc/mean@1"] == 0.5
    assert metrics["val-aux/openai/gsm8k/lenient/mean@1"] == 1.0
    assert metrics["val-aux/math/lenient/mean@1"] == 0.0


def test_log_val_generations_writes_each_validations_first_responses(setup, tmp_path):
    """verl's trainer.log_val_generations: the first N held-out responses of every validation, with
    their prompts, scores and the reward's predictions, in RUN_DIR/val_samples.jsonl."""
    import json

    from rl_run import config

    from hybridflow.controller.trainer import RLTrainer

    run_dir = tmp_path / "run"
    c = config(setup, run_dir, f"data.val_files=[{setup / 'prompts.jsonl'}]", "data.max_val_prompts=5",
               "trainer.total_training_steps=2", "trainer.test_freq=2", "trainer.val_before_train=true",
               "trainer.log_val_generations=3")  # fmt: skip
    RLTrainer(c).fit()
    rows = [json.loads(line) for line in (run_dir / "val_samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 0, 0, 2, 2, 2]  # before training and at the last step
    assert all(f"q{i}" in r["prompt"] for r, i in zip(rows, [0, 1, 2] * 2, strict=True))  # prompt order
    assert all(set(r) == {"step", "data_source", "prompt", "response", "score", "pred"} for r in rows)
    assert all(isinstance(r["response"], str) and isinstance(r["score"], float) for r in rows)


@pytest.mark.parametrize(
    "truth, answer",
    [
        (r"\frac{3}{4}", "0.75"),
        ("11", "11.0"),
        ("1024", "1,024"),
        (r"2\sqrt{2}", r"2\sqrt2"),
        ("3/4", r"\frac34"),
    ],
)
def test_the_math_scorer_compares_values_where_verls_compares_strings(truth, answer):
    """docs/config.md's deliberate difference: each form scores 1 here (verl's math_reward: 0)."""
    from hybridflow.rewards.scorers import compute_score

    assert compute_score("lighteval/MATH", rf"The answer is \boxed{{{answer}}}.", truth)["acc"] == 1.0
