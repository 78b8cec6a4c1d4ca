"""SFT: loss only on assistant turns (or the response), packing that changes nothing, a loss that
falls, exact resume, and a checkpoint the RL trainer starts from as it is."""

import json

import pytest
import torch
from rl_run import config as rl_config
from rl_run import read_metrics

from hybridflow.config import load_config
from hybridflow.models import byte_tokenizer
from hybridflow.offline import SFTTrainer
from hybridflow.offline.sft_data import messages_example, prompt_response_example

CONVERSATION = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo"},
    {"role": "user", "content": "q"},
    {"role": "assistant", "content": "ans"},
]


def _targets(example, tokenizer) -> str:
    return tokenizer.decode([t for t, m in zip(example.token_ids, example.loss_mask) if m])


def test_loss_masks_cover_assistant_turns_or_the_response_only():
    tokenizer = byte_tokenizer()
    example = messages_example(CONVERSATION, tokenizer, "row 0")
    assert tokenizer.decode(example.token_ids).count("<|im_start|>") == 5
    assert _targets(example, tokenizer) == "yo<|im_end|>\nans<|im_end|>\n"  # each turn with its end
    plain = prompt_response_example("2+2?", "4", tokenizer, chat=True, system_prompt=None, where="row 0")
    assert _targets(plain, tokenizer) == "4" + tokenizer.eos_token


def _sft_config(setup, run_dir, *overrides):
    return load_config(
        None,
        [
            f"model.path={setup / 'model'}",
            f"data.train_files=[{setup / 'sft.jsonl'}]",
            "sft.messages_key=messages",
            "sft.batch_size=8",
            "actor.optim.lr=3e-3",
            "actor.compute_dtype=float32",
            "actor.max_tokens_per_microbatch=96",  # several packed micro-batches per step
            "trainer.logger=[jsonl]",
            f"trainer.run_dir={run_dir}",
            *overrides,
        ],
    )


@pytest.fixture(scope="module")
def sft_setup(setup):
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"q{i}"},
                {"role": "assistant", "content": "a" * (3 + i % 5)},
            ]
        }
        for i in range(32)
    ]
    (setup / "sft.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return setup


def test_packed_micro_batch_gives_the_loss_of_each_example_alone(sft_setup, tmp_path):
    trainer = SFTTrainer(_sft_config(sft_setup, tmp_path / "run", "trainer.total_training_steps=1"))
    examples = trainer.train_examples[:5]
    with torch.no_grad():
        packed, targets = trainer._nll(examples)
        alone = [trainer._nll([e]) for e in examples]
    assert targets == sum(t for _, t in alone) == sum(sum(e.loss_mask) for e in examples)
    assert packed.item() == pytest.approx(sum(n.item() for n, _ in alone), rel=1e-5)


def _weights(trainer):
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.slow
def test_loss_falls_resume_is_exact_and_rl_starts_from_the_export(sft_setup, tmp_path):
    # save_freq=-1: as verl's SFT trainer, the offline trainers still save after the last step (global_step_6)
    straight = SFTTrainer(
        _sft_config(sft_setup, tmp_path / "a", "trainer.total_training_steps=6", "trainer.save_freq=-1")
    )
    straight.fit()
    SFTTrainer(_sft_config(sft_setup, tmp_path / "b", "trainer.total_training_steps=3")).fit()
    # killed after checkpoint 3 was written, before step 3's metrics were: the checkpoint keeps them
    logged = (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "b" / "metrics.jsonl").write_text("".join(line + "\n" for line in logged[:-1]))
    resumed = SFTTrainer(_sft_config(sft_setup, tmp_path / "b", "trainer.total_training_steps=6"))
    assert resumed.step == 3
    resumed.fit()
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [m["step"] for m in b] == [1, 2, 3, 4, 5, 6]
    assert [m["train/loss"] for m in a] == [m["train/loss"] for m in b]
    wa, wb = _weights(straight), _weights(resumed)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert "SFT loss" in (tmp_path / "a" / "report.html").read_text()  # the run's report, its loss curve
    assert a[-1]["train/loss"] < 0.7 * a[0]["train/loss"]  # it learns the answers' shape (5.1 -> 3.2)
    # the exported policy is the RL trainer's starting point, unconverted
    policy = tmp_path / "a" / "checkpoints" / "global_step_6" / "policy"
    from hybridflow.controller.trainer import RLTrainer

    rl = RLTrainer(
        rl_config(sft_setup, tmp_path / "rl", f"model.path={policy}", "trainer.total_training_steps=1")
    )
    exported = {k: v for k, v in rl.workers.worker.actor.model.state_dict().items()}
    assert all(torch.equal(exported[k], wa[k]) for k in wa)


def test_sigterm_finishes_the_step_saves_and_returns(sft_setup, tmp_path, capsys):
    """The offline trainers stop as the RL trainer does: the step in flight ends, a checkpoint is
    written, and the run goes on from it when started again."""
    import os
    import signal

    run = tmp_path / "run"
    trainer = SFTTrainer(_sft_config(sft_setup, run, "trainer.total_training_steps=6"))
    step = trainer.train_step

    def step_then_signal(batch):  # pre-emption arrives during step 2
        out = step(batch)
        if trainer.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    trainer.train_step = step_then_signal
    before = signal.getsignal(signal.SIGTERM)
    trainer.fit()
    assert "stopped by SIGTERM after step 2" in capsys.readouterr().out
    assert [m["step"] for m in read_metrics(run)] == [1, 2]
    assert (run / "checkpoints" / "global_step_2" / "trainer_state.json").is_file()
    assert signal.getsignal(signal.SIGTERM) is before  # the handlers are given back
    SFTTrainer(_sft_config(sft_setup, run, "trainer.total_training_steps=6")).fit()
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3, 4, 5, 6]


def test_settings_the_offline_trainers_would_not_honour_are_refused(sft_setup, tmp_path):
    """Offload, compile and more than one worker are RL-trainer features: `hybridflow sft` stops at
    once naming them, instead of training on one device as if they were set."""
    from hybridflow.errors import UserError

    config = _sft_config(sft_setup, tmp_path / "run", "model.compile=true", "actor.offload_optimizer=true")
    with pytest.raises(
        UserError, match=r"does not do model.compile=True, actor.offload_optimizer=True: remove them"
    ):
        SFTTrainer(config)
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_sft_with_lora_trains_the_adapters_only_and_exports_merged(sft_setup, tmp_path):
    """model.lora_rank applies to `hybridflow sft` as to RL: the base stays, the adapters learn, the
    export is the merged model (transformers loads it as is) with the adapter beside it."""
    from transformers import AutoModelForCausalLM

    trainer = SFTTrainer(
        _sft_config(sft_setup, tmp_path / "run", "model.lora_rank=4", "trainer.total_training_steps=4")
    )
    base = {k: v.clone() for k, v in trainer.model.state_dict().items() if "lora" not in k}
    trainer.fit()
    after = trainer.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items())  # the base is frozen
    assert any(not torch.equal(after[k], torch.zeros_like(after[k])) for k in after if "lora_B" in k)
    losses = [m["train/loss"] for m in read_metrics(tmp_path / "run")]
    assert losses[-1] < losses[0]
    checkpoint = tmp_path / "run" / "checkpoints" / "global_step_4"
    assert (checkpoint / "policy_adapter" / "adapter_config.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(checkpoint / "policy").eval()
    trainer.model.eval()
    with torch.no_grad():  # the export's log-probs are the adapted policy's
        ours = trainer.response_logprobs(trainer.model, [[5, 6, 7]], [[8, 9, 10]])[0]
        logits = merged(torch.tensor([[5, 6, 7, 8, 9, 10]])).logits[0, 2:5].log_softmax(-1)
    theirs = logits.gather(-1, torch.tensor([[8], [9], [10]]))[:, 0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_float16_sft_steps_as_float32_does(sft_setup, tmp_path):
    """SFT under float16 autocast with the loss scale: one step moves the weights the way float32's
    step does (Adam's first step is lr x the gradient's sign), where float16 alone would flush small
    gradients to zero."""

    def step(dtype: str):
        trainer = SFTTrainer(_sft_config(sft_setup, tmp_path / dtype, "trainer.total_training_steps=1",
                                         f"actor.compute_dtype={dtype}", "actor.optim.weight_decay=0"))  # fmt: skip
        before = _weights(trainer)
        trainer.fit()
        after = _weights(trainer)
        return torch.cat([(after[k] - before[k]).flatten() for k in before]), trainer

    reference, _ = step("float32")
    deltas, trainer = step("float16")
    assert trainer.loss_scale.enabled and trainer.loss_scale.scale <= 2.0**16
    agree = ((deltas.sign() == reference.sign()) | (reference.abs() < 1e-7)).float().mean().item()
    assert agree > 0.99, agree


def test_verls_sft_script_runs_as_written(sft_setup, tmp_path, capsys):
    """verl's examples/sft/gsm8k script, keys as written (prompt and response inside extra_info,
    `+data.response_dict_keys`, console logging only): 4 examples a step, the answer is the target,
    and the run directory still holds metrics.jsonl and the report."""
    from hybridflow.cli import main
    from hybridflow.config.loader import resolve_config
    from hybridflow.offline.sft_data import load_examples

    rows = [{"extra_info": {"question": f"q{i}", "answer": f"A{i}"}} for i in range(12)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    argv = [
        f"data.train_files={tmp_path / 'train.jsonl'}", "data.prompt_key=extra_info", "data.response_key=extra_info",
        "optim.lr=1e-4", "data.prompt_dict_keys=['question']", "+data.response_dict_keys=['answer']",
        "data.micro_batch_size_per_gpu=4", "data.train_batch_size=4", f"model.partial_pretrain={sft_setup / 'model'}",
        f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.project_name=gsm8k-sft", "trainer.logger=console",
        "trainer.total_training_steps=2", "trainer.total_epochs=4", "ulysses_sequence_parallel_size=2",
        "use_remove_padding=true",
    ]  # fmt: skip
    config = resolve_config(None, argv, command="sft").config
    assert (config.sft.batch_size, config.sft.prompt_key, config.sft.response_key) == (
        4, "extra_info.question", "extra_info.answer",
    )  # fmt: skip
    assert config.actor.optim.lr == 1e-4 and config.model.path == str(sft_setup / "model")
    tokenizer = byte_tokenizer()
    example = load_examples(config.data.train_files, tokenizer, config)[3]
    assert _targets(example, tokenizer) == "A3" + tokenizer.eos_token
    assert main(["sft", *argv]) == 0
    out = capsys.readouterr().out
    assert "sft: 12 examples, 4 per step, 2 steps" in out
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2]  # console only, and still the record
    assert (tmp_path / "run" / "report.html").is_file()
    # a batch the data cannot fill names the key that was given and the one it became
    assert main(["sft", *argv, "data.train_batch_size=40", "--overwrite"]) == 2
    assert (
        "sft.batch_size=40 (verl: data.train_batch_size) exceeds the 12 training examples"
        in capsys.readouterr().err
    )


def test_trls_dataset_formats_are_recognised(tmp_path):
    """TRL's SFT formats by their columns, with sft.* at its defaults: conversational `messages`,
    prompt-completion and plain `text` (every token a target)."""
    tokenizer = byte_tokenizer()
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"prompt": "2+2?", "completion": "4"},
        {"text": "abc"},
    ]
    (tmp_path / "mixed.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    config = load_config(None, [f"data.train_files=[{tmp_path / 'mixed.jsonl'}]"])
    from hybridflow.offline.sft_data import load_examples

    chat, completion, text = load_examples(config.data.train_files, tokenizer, config)
    assert _targets(chat, tokenizer) == "yo<|im_end|>\n"
    assert _targets(completion, tokenizer) == "4" + tokenizer.eos_token
    assert text.loss_mask == [0] + [1] * (len(text.token_ids) - 1)
    assert tokenizer.decode(text.token_ids).endswith("abc" + tokenizer.eos_token)
