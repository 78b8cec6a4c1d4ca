import json
import re

import pytest

from hybridflow.cli import main


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for command in ("generate", "config", "data"):
        assert command in out


def test_generate_prints_completions_and_closing_line(tiny_dir, capsys):
    assert (
        main(["generate", "--model", str(tiny_dir), "--prompt", "hi", "--n", "2", "--max-tokens", "5"]) == 0
    )
    out = capsys.readouterr().out
    assert out.count("--- prompt 0") == 2
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(r"generated \d+ tokens in \d+\.\d\d s \(\d+\.\d tok/s\)", last)


def test_generate_backends_agree_greedily(tiny_dir, tmp_path, capsys):
    """--backend native (the engine) and --backend hf (transformers) write the same greedy completions."""
    outputs = {}
    for backend in ("native", "hf"):
        out = tmp_path / f"{backend}.jsonl"
        args = ["generate", "--model", str(tiny_dir), "--prompt", "hi", "--prompt", "a longer prompt"]
        assert (
            main([*args, "--temperature", "0", "--max-tokens", "6", "--backend", backend, "--out", str(out)])
            == 0
        )
        outputs[backend] = [json.loads(line)["completion"] for line in out.read_text().splitlines()]
        assert re.search(r"generated \d+ tokens in", capsys.readouterr().out)
    assert outputs["native"] == outputs["hf"] and len(outputs["hf"]) == 2


def test_generate_writes_jsonl_and_never_overwrites(tiny_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"prompt": [{"role": "user", "content": "x"}]}) + "\n" + json.dumps({"prompt": "y"}) + "\n"
    )
    out = tmp_path / "out.jsonl"
    assert (
        main(
            [
                "generate",
                "--model",
                str(tiny_dir),
                "--prompts-file",
                str(prompts),
                "--max-tokens",
                "4",
                "--temperature",
                "0",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2 and records[0]["prompt"].startswith("<|im_start|>user\nx")
    assert {"completion", "finish_reason", "num_tokens"} <= set(records[0])
    before = out.read_text()
    assert main(["generate", "--model", str(tiny_dir), "--prompt", "z", "--out", str(out)]) == 2
    assert "exists" in capsys.readouterr().err
    assert out.read_text() == before


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--model", "/no/such/model", "--prompt", "x"], "model path not found: /no/such/model"),
        (["generate", "--prompts-file", "/no/file.jsonl"], "data file not found"),
        (["config", "show", "actor.optim.lrr=1"], "'actor.optim.lrr' is not a config key"),
        (["config", "show", "missing.yaml"], "recipe file not found: missing.yaml"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and err[0].startswith("hybridflow: error:")


def test_overrides_after_an_option_are_overrides(capsys):
    assert (
        main(
            [
                "config",
                "show",
                "rollout.samples_per_prompt=6",
                "--explain",
                "rollout.top_k",
                "rollout.top_k=5",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "rollout.top_k" in out and "5" in out
    with pytest.raises(SystemExit):
        main(["config", "show", "--explain", "rollout.top_k", "--no-such-option"])
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err


def test_config_show_prints_resolved_yaml(capsys):
    assert main(["config", "show", "rollout.samples_per_prompt=6"]) == 0
    out = capsys.readouterr().out
    assert "samples_per_prompt: 6" in out and "run_dir: runs/run" in out


def test_data_make_writes_splits(tmp_path, capsys):
    assert (
        main(
            [
                "data",
                "make",
                "arithmetic",
                "--out",
                str(tmp_path / "a"),
                "--train-size",
                "20",
                "--test-size",
                "5",
            ]
        )
        == 0
    )
    assert (tmp_path / "a" / "train.parquet").is_file() and (tmp_path / "a" / "test.parquet").is_file()
    assert main(["data", "make", "arithmetic", "--out", str(tmp_path / "a")]) == 2
