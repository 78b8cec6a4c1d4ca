"""The tokenized prompt cache: the same prompts as tokenizing (indices across files, filtered rows),
read without tokenizing the second time, and rebuilt when the file, template or settings change."""

import json

import pytest

import hybridflow.data.prompts as prompts_module
from hybridflow.config.schema import DataConfig
from hybridflow.data import PackedDataset, load_prompts
from hybridflow.errors import UserError
from hybridflow.models import byte_tokenizer


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def files(tmp_path):
    a = [{"prompt": [{"role": "user", "content": f"{i} + {i} = ?"}], "data_source": "arithmetic",
          "reward_model": {"ground_truth": str(2 * i)}, "extra_info": {"index": i, "tags": ["x", i]}}
         for i in range(5)]  # fmt: skip
    a[2]["prompt"][0]["content"] = "long " * 40  # filtered: over max_prompt_tokens
    b = [{"prompt": "plain é ✓", "answer": "7"}, {"prompt": "another", "answer": "8"}]
    return [_write(tmp_path / "a.jsonl", a), _write(tmp_path / "b.jsonl", b)]


CONFIG = DataConfig(max_prompt_tokens=100, answer_key="answer", data_source="plain")


def test_cached_prompts_equal_tokenized_ones_and_are_not_tokenized_again(files, tmp_path, monkeypatch):
    tok = byte_tokenizer()
    fresh = load_prompts(files, tok, CONFIG)
    assert [p.index for p in fresh] == [0, 1, 3, 4, 5, 6]  # row 2 filtered; b's rows follow a's 5
    first = load_prompts(files, tok, CONFIG, cache_root=tmp_path / "cache")

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(prompts_module, "rows_to_prompts", no_tokenizing)
    again = load_prompts(files, tok, CONFIG, cache_root=tmp_path / "cache")
    assert first == fresh and again == fresh  # every field: ids, index, source, truth, extras, text
    packed = PackedDataset.load(files[0], tok, CONFIG, tmp_path / "cache")
    assert (len(packed), packed.rows, packed.overlong) == (4, 5, 1)
    assert packed.tokens.dtype.name == "int32" and packed.tokens.filename  # memory-mapped


def test_a_changed_file_template_or_setting_is_tokenized_anew(files, tmp_path):
    tok, cache = byte_tokenizer(), tmp_path / "cache"
    load_prompts(files[:1], tok, CONFIG, cache_root=cache)
    rows = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    rows[0]["reward_model"]["ground_truth"] = "1"  # same size, same second: only the bytes differ
    _write(tmp_path / "a.jsonl", rows)
    assert load_prompts(files[:1], tok, CONFIG, cache_root=cache)[0].ground_truth == "1"
    system = DataConfig(max_prompt_tokens=100, system_prompt="Be brief.")
    assert "Be brief." in load_prompts(files[:1], tok, system, cache_root=cache)[0].text
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert load_prompts(files[:1], tok, CONFIG, cache_root=cache)[0].text == "0 + 0 = ?"
    assert len(list((cache / "prompts").iterdir())) == 4


def test_a_half_written_cache_folder_is_not_used(files, tmp_path):
    tok, cache = byte_tokenizer(), tmp_path / "cache"
    load_prompts(files[:1], tok, CONFIG, cache_root=cache)
    (folder,) = (cache / "prompts").iterdir()
    (folder / "header.json").unlink()  # as if the writer died before its last file
    (folder / "prompts.jsonl").write_text("")
    assert load_prompts(files[:1], tok, CONFIG, cache_root=cache) == load_prompts(files[:1], tok, CONFIG)


@pytest.mark.parametrize("damage", ["token", "header", "offsets", "missing"])
def test_a_damaged_cache_folder_is_tokenized_again_not_trusted(files, tmp_path, damage):
    """A changed token id (one flipped number in tokens.npy), a torn header, offsets that do not
    match, a missing file: each is seen (digests and shapes), said, and the prompts tokenized again."""
    import numpy as np

    tok, cache = byte_tokenizer(), tmp_path / "cache"
    fresh = load_prompts(files[:1], tok, CONFIG)
    load_prompts(files[:1], tok, CONFIG, cache_root=cache)
    (folder,) = (cache / "prompts").iterdir()
    if damage == "token":
        tokens = np.load(folder / "tokens.npy")
        tokens[3] += 1
        np.save(folder / "tokens.npy", tokens)
    elif damage == "header":
        (folder / "header.json").write_text('{"rows": 5, "over')
    elif damage == "offsets":
        np.save(folder / "offsets.npy", np.array([0, 1], dtype=np.int64))
    else:
        (folder / "prompts.jsonl").unlink()
    assert load_prompts(files[:1], tok, CONFIG, cache_root=cache) == fresh


def test_errors_name_the_file(tmp_path):
    with pytest.raises(UserError, match="data file not found: .*missing.jsonl"):
        load_prompts([str(tmp_path / "missing.jsonl")], byte_tokenizer(), CONFIG, cache_root=tmp_path)
