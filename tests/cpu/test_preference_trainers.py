"""DPO and KTO on a tiny model: a few steps raise the chosen-vs-rejected margin; DPO's reference
scored up front gives the same steps as scoring it on the fly; resume continues a DPO run exactly."""

import json

import pytest
from rl_run import read_metrics

from hybridflow.config import load_config
from hybridflow.errors import UserError
from hybridflow.offline import DPOTrainer, KTOTrainer


@pytest.fixture(scope="module")
def data(setup):
    pairs = [
        {"prompt": f"q{i}", "chosen": "a" * (2 + i % 3), "rejected": "b" * (2 + i % 4)} for i in range(24)
    ]
    (setup / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in pairs))
    labelled = [
        {"prompt": f"q{i}", "completion": ("a" if i % 2 else "b") * 3, "label": bool(i % 2)}
        for i in range(24)
    ]
    (setup / "kto.jsonl").write_text("\n".join(json.dumps(r) for r in labelled))
    return setup


def _config(setup, run_dir, data_file, *overrides):
    return load_config(None, [
        f"model.path={setup / 'model'}", f"data.train_files=[{setup / data_file}]", "preference.batch_size=8",
        "preference.beta=0.5", "actor.optim.lr=2e-3", "actor.compute_dtype=float32",
        "actor.max_tokens_per_microbatch=64", "trainer.logger=[jsonl]", f"trainer.run_dir={run_dir}", *overrides,
    ])  # fmt: skip


@pytest.mark.slow
def test_dpo_raises_the_margin_and_its_cached_reference_changes_nothing(data, tmp_path):
    DPOTrainer(_config(data, tmp_path / "cached", "pairs.jsonl", "trainer.total_training_steps=6")).fit()
    cached = read_metrics(tmp_path / "cached")
    assert cached[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at first
    assert cached[-1]["rewards/margins"] > 0.5 and cached[-1]["rewards/accuracies"] == 1.0
    assert cached[-1]["train/loss"] < cached[0]["train/loss"]
    live = _config(data, tmp_path / "live", "pairs.jsonl", "trainer.total_training_steps=6",
                   "preference.precompute_ref_logprobs=false")  # fmt: skip
    DPOTrainer(live).fit()
    for a, b in zip(cached, read_metrics(tmp_path / "live")):
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5)
    # resumed after 3 steps: the reference is the starting policy again, not the checkpoint
    DPOTrainer(_config(data, tmp_path / "resumed", "pairs.jsonl", "trainer.total_training_steps=3")).fit()
    DPOTrainer(_config(data, tmp_path / "resumed", "pairs.jsonl", "trainer.total_training_steps=6")).fit()
    resumed = read_metrics(tmp_path / "resumed")
    assert [m["train/loss"] for m in resumed] == pytest.approx([m["train/loss"] for m in cached], rel=1e-6)


def test_rpo_alpha_adds_the_chosen_nll_and_keeps_the_chosen_likely(data, tmp_path):
    def run(name, *overrides):
        DPOTrainer(
            _config(data, tmp_path / name, "pairs.jsonl", "trainer.total_training_steps=4", *overrides)
        ).fit()
        return read_metrics(tmp_path / name)

    plain, rpo = run("dpo"), run("rpo", "preference.rpo_alpha=1.0")
    first = rpo[0]  # policy == reference: the DPO term is log 2, the rest is the chosen token-mean NLL
    assert first["train/loss"] == pytest.approx(0.693147 + first["nll_loss"], abs=1e-5)
    assert first["nll_loss"] > 0 and "nll_loss" not in plain[0]
    assert rpo[-1]["logps/chosen"] > plain[-1]["logps/chosen"]
    with pytest.raises(UserError, match="preference.rpo_alpha=-1"):
        _config(data, tmp_path / "bad", "pairs.jsonl", "preference.rpo_alpha=-1")


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["ipo", "simpo"])
def test_dpo_variants_learn_the_preference(data, tmp_path, loss):
    run = _config(
        data, tmp_path / loss, "pairs.jsonl", "trainer.total_training_steps=6", f"preference.loss_type={loss}"
    )
    DPOTrainer(run).fit()
    metrics = read_metrics(tmp_path / loss)
    # learning: ipo 0.00 -> 0.37, simpo -0.04 -> 1.17; with the loss zeroed AdamW's weight decay alone
    # moves the margin by less than 0.02 (measured), which a bare `>` let pass
    assert metrics[-1]["rewards/margins"] > metrics[0]["rewards/margins"] + 0.1


@pytest.mark.slow
def test_kto_separates_desirable_from_undesirable(data, tmp_path):
    KTOTrainer(_config(data, tmp_path / "kto", "kto.jsonl", "trainer.total_training_steps=6")).fit()
    metrics = read_metrics(tmp_path / "kto")
    assert metrics[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6) and metrics[0]["kl"] == 0.0
    assert metrics[-1]["rewards/margins"] > 0.5
    assert metrics[-1]["rewards/chosen"] > 0 > metrics[-1]["rewards/rejected"]


def test_a_row_without_its_column_is_named(data, tmp_path):
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "q", "chosen": "a"}) + "\n")
    with pytest.raises(UserError, match=r"bad.jsonl: row 0 has no 'rejected' \(keys: chosen, prompt\)"):
        DPOTrainer(_config(data, tmp_path / "run", tmp_path / "bad.jsonl"))  # an absolute path stays one


def test_pairs_with_an_implicit_prompt_take_the_start_they_share(tmp_path):
    """TRL's implicit-prompt rows (no prompt column; chosen and rejected conversations, or texts,
    that start alike): the shared start is the prompt, as TRL's extract_prompt splits them."""
    from hybridflow.config import load_config
    from hybridflow.models import byte_tokenizer
    from hybridflow.offline.preference_data import implicit_prompt, load_pairs

    user = {"role": "user", "content": "What color is the sky?"}
    rows = [
        {"chosen": [user, {"role": "assistant", "content": "blue"}],
         "rejected": [user, {"role": "assistant", "content": "green"}]},
        {"chosen": "Q: 2+2? A: 4", "rejected": "Q: 2+2? A: 5"},
    ]  # fmt: skip
    assert implicit_prompt(rows[1]["chosen"], rows[1]["rejected"], "row 1") == ("Q: 2+2? A:", " 4", " 5")
    (tmp_path / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    config = load_config(None, [f"data.train_files=[{tmp_path / 'pairs.jsonl'}]"])
    tokenizer = byte_tokenizer()
    chat, _ = load_pairs(config.data.train_files, tokenizer, config)
    assert tokenizer.decode(chat.prompt).count("What color is the sky?") == 1
    assert tokenizer.decode(chat.chosen) == "blue" + tokenizer.eos_token
    (tmp_path / "bad.jsonl").write_text(json.dumps({"chosen": "yes", "rejected": "no"}) + "\n")
    with pytest.raises(UserError, match="share no start"):
        load_pairs([str(tmp_path / "bad.jsonl")], tokenizer, config)


def test_trls_dpo_and_sft_quick_starts_run_as_written(setup, tmp_path, monkeypatch, capsys):
    """TRL's documented calls: `DPOTrainer(model=model, args=DPOConfig(...), processing_class=tokenizer,
    train_dataset=dataset)` with live objects, `SFTTrainer(model=path, train_dataset=dataset)` with TRL's
    defaults (2e-5, 8 examples a step), then train() and save_model()."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridflow import DPOConfig, SFTConfig, SFTTrainer

    monkeypatch.chdir(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(setup / "model")
    tokenizer = AutoTokenizer.from_pretrained(setup / "model")
    user = lambda i: {"role": "user", "content": f"q{i}"}  # noqa: E731
    pairs = datasets.Dataset.from_list(
        [{"chosen": [user(i), {"role": "assistant", "content": "aaa"}],
          "rejected": [user(i), {"role": "assistant", "content": "bbb"}]} for i in range(16)]
    )  # fmt: skip
    dpo = DPOTrainer(model=model, args=DPOConfig(output_dir="dpo", logging_steps=10, max_steps=2),
                     processing_class=tokenizer, train_dataset=pairs)  # fmt: skip
    assert (dpo.config.preference.beta, dpo.config.preference.loss_type, dpo.config.actor.optim.lr) == (
        0.1,
        "sigmoid",
        1e-6,
    )
    assert dpo.config.preference.batch_size == 8
    dpo.train()
    assert [m["step"] for m in read_metrics(tmp_path / "dpo")] == [1, 2]
    assert (tmp_path / "dpo" / "inputs" / "actor" / "model.safetensors").is_file()
    chats = datasets.Dataset.from_list(
        [{"messages": [user(i), {"role": "assistant", "content": "a" * (1 + i % 3)}]} for i in range(16)]
    )
    sft = SFTTrainer(
        model=str(setup / "model"), train_dataset=chats, args=SFTConfig(output_dir="sft", max_steps=2)
    )
    assert (sft.config.sft.batch_size, sft.config.actor.optim.lr, sft.config.sft.max_tokens) == (
        8,
        2e-5,
        1024,
    )
    assert (
        "SFTConfig starts from TRL's defaults, except a conversation's loss is on its assistant turns"
        in capsys.readouterr().out
    )
    sft.train()
    saved = sft.save_model(tmp_path / "sft_model")
    assert (saved / "config.json").is_file()
    with pytest.raises(UserError, match="SFTTrainer does not take callbacks: transformers' TrainerCallback"):
        SFTTrainer(model=str(setup / "model"), train_dataset=chats, callbacks=[object()])
