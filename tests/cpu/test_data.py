import json
import re

import pytest

from hybridflow.config import DataConfig
from hybridflow.data import load_prompts, read_rows, rows_to_prompts, write_rows
from hybridflow.data.preprocess import preprocess
from hybridflow.data.tasks import make_task
from hybridflow.data.tasks.arithmetic import solve_steps, written_solution
from hybridflow.errors import UserError
from hybridflow.models import byte_tokenizer

VERL_ROW = {
    "data_source": "openai/gsm8k",
    "prompt": [{"role": "user", "content": "1+1?"}],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "2"},
    "extra_info": {"index": 0},
}


@pytest.fixture
def tok():
    return byte_tokenizer()


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_verl_rows_round_trip_through_files(tmp_path, suffix, tok):
    path = write_rows(
        [VERL_ROW, VERL_ROW | {"reward_model": {"style": "rule", "ground_truth": "3"}}],
        tmp_path / f"d{suffix}",
    )
    prompts = load_prompts([str(path)], tok, DataConfig())
    assert [p.ground_truth for p in prompts] == ["2", "3"]
    assert prompts[0].data_source == "openai/gsm8k"
    assert prompts[0].text == "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"
    assert prompts[0].token_ids == tok(prompts[0].text, add_special_tokens=False)["input_ids"]


def test_json_and_hf_dataset_directory(tmp_path, tok):
    import datasets

    (tmp_path / "d.json").write_text(json.dumps([{"question": "2+2?", "answer": "4"}]))
    datasets.Dataset.from_list([{"question": "3+3?", "answer": "6"}]).save_to_disk(str(tmp_path / "hfdir"))
    config = DataConfig(prompt_key="question", answer_key="answer", data_source="arithmetic")
    prompts = load_prompts([str(tmp_path / "d.json"), str(tmp_path / "hfdir")], tok, config)
    assert [(p.index, p.ground_truth, p.data_source) for p in prompts] == [
        (0, "4", "arithmetic"),
        (1, "6", "arithmetic"),
    ]


def test_plain_prompt_without_chat_template(tok):
    config = DataConfig(prompt_key="q", answer_key="a", apply_chat_template=False)
    (p,) = rows_to_prompts([{"q": "abc", "a": 1}], tok, config)
    assert p.text == "abc" and p.token_ids == [97, 98, 99] and p.data_source == "unknown"


def test_overlong_prompts_are_filtered_with_a_count_or_rejected(tok, caplog):
    rows = [{"prompt": "x" * n} for n in (5, 50, 6)]
    config = DataConfig(max_prompt_tokens=30)
    kept = rows_to_prompts(rows, tok, config, source="d.jsonl")
    assert [p.index for p in kept] == [0, 2]
    assert "filtered 1 of 3 prompts" in caplog.text
    with pytest.raises(UserError, match=r"d.jsonl: row 1: prompt has 6\d tokens > data.max_prompt_tokens=30"):
        rows_to_prompts(
            rows, tok, DataConfig(max_prompt_tokens=30, overlong_prompts="error"), source="d.jsonl"
        )


def test_a_lone_surrogate_is_named_not_a_tokenizer_traceback(tok, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "abc\\ud800def", "reward_model": {"ground_truth": "1"}}\n')
    with pytest.raises(
        UserError,
        match=r"row 0: 'prompt' is not valid Unicode text \(surrogates not allowed at character 3\)",
    ):
        load_prompts([str(path)], tok, DataConfig(cache_tokenized=False))


def test_overlong_prompts_truncated_left_or_right_as_verls_truncation(tok):
    rows = [{"prompt": "abcdefghij"}]
    plain = DataConfig(max_prompt_tokens=4, apply_chat_template=False)
    (left,) = rows_to_prompts(
        rows, tok, DataConfig(**{**plain.__dict__, "overlong_prompts": "truncate_left"})
    )
    (right,) = rows_to_prompts(
        rows, tok, DataConfig(**{**plain.__dict__, "overlong_prompts": "truncate_right"})
    )
    assert (left.token_ids, left.text) == ([103, 104, 105, 106], "ghij")  # the end of the prompt is kept
    assert (right.token_ids, right.text) == ([97, 98, 99, 100], "abcd")


def test_chat_template_kwargs_reach_the_template(tok):
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}{% if greet %}!{% endif %}"
    (p,) = rows_to_prompts([{"prompt": "hi"}], tok, DataConfig(chat_template_kwargs={"greet": True}))
    assert p.text == "hi!"


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"prompt": "ok"}, {"question": "x"}], "d.jsonl: row 1 has no 'prompt' key (keys: question)"),
        (
            [{"prompt": 42}],
            "d.jsonl: row 0: 'prompt' must be a string or a list of {role, content} messages, got int",
        ),
        ([{"prompt": [{"role": "user"}]}], "row 0: 'prompt' must be a string or a list"),
        ([{"prompt": "   "}], "row 0: 'prompt' is an empty string"),
        ([{"prompt": "x" * 100}], "no prompts left (1 rows, 1 over max_prompt_tokens)"),
    ],
)
def test_bad_rows_name_file_and_row(rows, message, tok):
    with pytest.raises(UserError) as e:
        rows_to_prompts(rows, tok, DataConfig(max_prompt_tokens=60), source="d.jsonl")
    assert message in str(e.value)


def test_bad_files(tmp_path):
    with pytest.raises(UserError, match="data file not found"):
        read_rows(tmp_path / "missing.parquet")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(UserError, match="cannot read parquet file .*broken.parquet"):
        read_rows(tmp_path / "broken.parquet")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(UserError, match=r"bad.jsonl:2: not valid UTF-8 JSON"):
        read_rows(tmp_path / "bad.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(UserError, match="unknown format '.csv'"):
        read_rows(tmp_path / "x.csv")
    with pytest.raises(UserError, match="no data files given"):
        load_prompts([], None, DataConfig())


def test_arithmetic_task_is_seeded_disjoint_and_correct(tmp_path):
    a = make_task(
        "arithmetic", tmp_path / "a", train_size=300, test_size=50, seed=1, operators="+-*", max_operands=3
    )
    b = make_task(
        "arithmetic", tmp_path / "b", train_size=300, test_size=50, seed=1, operators="+-*", max_operands=3
    )
    train, test = read_rows(a["train"]), read_rows(a["test"])
    assert train == read_rows(b["train"])  # same seed, same data
    assert {r["extra_info"]["expression"] for r in train}.isdisjoint(
        r["extra_info"]["expression"] for r in test
    )
    for row in train + test:
        expression = row["extra_info"]["expression"]
        # Python's own precedence is the reference for these small integer expressions
        assert str(eval(expression)) == row["reward_model"]["ground_truth"]  # noqa: S307 - our own digits
        assert row["extra_info"]["solution"].endswith("#### " + row["reward_model"]["ground_truth"])


def test_arithmetic_steps_respect_precedence():
    assert solve_steps([2, 3, 4], ["+", "*"]) == (14, ["3 * 4 = 12", "2 + 12 = 14"])
    assert solve_steps([9, 4, 2], ["-", "-"]) == (3, ["9 - 4 = 5", "5 - 2 = 3"])


def test_flawed_teacher_stops_early_on_the_same_problems(tmp_path):
    assert written_solution(["9 - 4 = 5", "5 - 2 = 3"], stop_early=False) == "9 - 4 = 5\n5 - 2 = 3\n#### 3"
    assert written_solution(["9 - 4 = 5", "5 - 2 = 3"], stop_early=True) == "9 - 4 = 5\n#### 5"
    options = dict(train_size=400, test_size=50, seed=0, min_operands=2, max_operands=3)
    clean = read_rows(make_task("arithmetic", tmp_path / "clean", **options)["train"])
    flawed = read_rows(
        make_task("arithmetic", tmp_path / "flawed", stop_early_fraction=0.6, **options)["train"]
    )
    stopped = 0
    for a, b in zip(clean, flawed, strict=True):
        # the problems and their ground truths are the clean task's; only some solutions change
        assert (a["prompt"], a["reward_model"]) == (b["prompt"], b["reward_model"])
        steps = a["extra_info"]["solution"].split("\n")[:-1]
        if b["extra_info"]["solution"] != a["extra_info"]["solution"]:
            assert len(steps) == 2  # one-step problems have nothing to stop early from
            assert b["extra_info"]["solution"] == f"{steps[0]}\n#### {steps[0].split(' = ')[1]}"
            stopped += 1
    two_step = sum(len(r["extra_info"]["solution"].split("\n")) == 3 for r in clean)
    assert 0.5 < stopped / two_step < 0.7
    with pytest.raises(UserError, match=r"stop_early_fraction must be in \[0, 1\], got 1.5"):
        make_task("arithmetic", tmp_path / "bad", stop_early_fraction=1.5)


def test_countdown_instances_are_solvable(tmp_path):
    paths = make_task("countdown", tmp_path, train_size=100, test_size=20, seed=0)
    for row in read_rows(paths["train"]):
        gt, solution = row["reward_model"]["ground_truth"], row["extra_info"]["solution"]
        assert sorted(int(n) for n in re.findall(r"\d+", solution)) == sorted(gt["numbers"])
        assert eval(solution) == gt["target"]  # noqa: S307 - generated by us


def test_unknown_task_and_bad_spec(tmp_path):
    with pytest.raises(UserError, match="unknown task 'sudoku'"):
        make_task("sudoku", tmp_path)
    with pytest.raises(UserError, match="operators must be"):
        make_task("arithmetic", tmp_path, operators="/")
    with pytest.raises(UserError, match="could not find 300 distinct train problems"):  # 10 x 10 x 2 exist
        make_task("arithmetic", tmp_path, train_size=300, test_size=10, max_digits=1)


def test_preprocess_gsm8k_and_math(tmp_path):
    gsm = write_rows(
        [{"question": "Tom has 1,200 apples...", "answer": "He has 1,200 + 34 = 1234\n#### 1,234"}],
        tmp_path / "gsm.jsonl",
    )
    out = preprocess("gsm8k", str(gsm), str(tmp_path / "gsm8k.parquet"))
    (row,) = read_rows(out)
    assert row["data_source"] == "openai/gsm8k"
    assert row["reward_model"]["ground_truth"] == "1234"
    assert row["prompt"][0]["content"].endswith(
        'Let\'s think step by step and output the final answer after "####".'
    )

    math = write_rows(
        [
            {
                "problem": "Half of 1?",
                "solution": r"It is $\boxed{\frac{1}{2}}$.",
                "level": "Level 1",
                "type": "Algebra",
            }
        ],
        tmp_path / "m.jsonl",
    )
    (row,) = read_rows(preprocess("math", str(math), str(tmp_path / "math.jsonl")))
    assert row["reward_model"]["ground_truth"] == r"\frac{1}{2}"
    assert row["prompt"][0]["content"].endswith("within \\boxed{}.")

    with pytest.raises(UserError, match=r"row 0 has no 'answer' key"):
        preprocess(
            "gsm8k", str(write_rows([{"question": "q"}], tmp_path / "bad.jsonl")), str(tmp_path / "o.jsonl")
        )
    with pytest.raises(UserError, match="exists"):
        preprocess("gsm8k", str(gsm), str(out))


def test_deeply_nested_rows_are_named_not_a_recursion_traceback(tok, tmp_path):
    """A line nested 100,000 deep cannot be parsed; one nested 900 deep in extra_info parses but
    could not reach a reward worker (pickling recurses): both are one line naming the row."""
    deep_line = tmp_path / "deep.jsonl"
    deep_line.write_text('{"prompt": "ok"}\n{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    with pytest.raises(UserError, match=r"deep\.jsonl:2: JSON nested too deeply to read"):
        load_prompts([str(deep_line)], tok, DataConfig(cache_tokenized=False))
    nested = 1
    for _ in range(900):
        nested = [nested]
    deep_info = tmp_path / "info.jsonl"
    deep_info.write_text(json.dumps({"prompt": "hi", "extra_info": {"x": nested}}) + "\n")
    with pytest.raises(UserError, match=r"row 0: 'extra_info' is nested more than 100 levels deep"):
        load_prompts([str(deep_info)], tok, DataConfig(cache_tokenized=False))
    ok = [{"prompt": "hi", "extra_info": {"x": [[[[1]]]]}}]  # ordinary nesting is fine
    assert len(rows_to_prompts(ok, tok, DataConfig())) == 1


def test_fewer_prompts_than_one_step_needs_is_one_line(tok):
    from hybridflow.data.sampler import PromptSampler

    prompts = rows_to_prompts([{"prompt": f"q{i}"} for i in range(3)], tok, DataConfig())
    with pytest.raises(UserError, match=r"data.prompts_per_step=8 .* exceeds the 3 training prompts"):
        PromptSampler(prompts, 8, seed=0, shuffle=True)
