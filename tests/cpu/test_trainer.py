"""The RL trainer end to end on a tiny model: learning curves, resume equality, export, bad input."""

import sys

import pytest
import torch
from rl_run import config, read_metrics
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from hybridflow.config.sections_run import due
from hybridflow.controller.divergence import TrainingDiverged
from hybridflow.controller.graceful_stop import stop_with_checkpoint
from hybridflow.controller.trainer import RLTrainer
from hybridflow.errors import UserError
from hybridflow.models import byte_tokenizer, save_hf

ALGORITHMS = {
    "grpo": [],
    "rloo": ["algorithm.adv_estimator=rloo"],
    "reinforce_plus_plus": ["algorithm.adv_estimator=reinforce_plus_plus"],
    "gae": ["algorithm.adv_estimator=gae", "critic.optim.lr=5e-3"],
    "grpo_transformers": ["model.impl=hf"],
    "gae_transformers": ["algorithm.adv_estimator=gae", "critic.optim.lr=5e-3", "model.impl=hf"],
    "dapo": [
        "algorithm.filter_groups.enable=true",
        "actor.clip_ratio_high=0.28",
        "actor.loss_agg_mode=token-mean",
        "reward.overlong_buffer.enable=true",
        "reward.overlong_buffer.buffer_tokens=4",
        "reward.overlong_buffer.penalty_factor=0.1",
    ],
}


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_policy_gradient_climbs_the_synthetic_reward(setup, tmp_path, name):
    RLTrainer(config(setup, tmp_path / "run", *ALGORITHMS[name])).fit()
    scores = [m["critic/score/mean"] for m in read_metrics(tmp_path / "run")]
    assert len(scores) == 20
    first, last = sum(scores[:4]) / 4, sum(scores[-4:]) / 4
    print(f"{name}: score {first:.3f} -> {last:.3f}")
    assert last > first + 0.25, f"{name}: score {first:.3f} -> {last:.3f}"


def test_metrics_use_verls_names_and_errors_are_counted(setup, tmp_path):
    RLTrainer(
        config(setup, tmp_path / "run", "trainer.total_training_steps=2", "actor.use_kl_loss=true")
    ).fit()
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == [1, 2]
    for key in (
        "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm",
        "actor/lr", "critic/score/mean", "critic/rewards/mean", "critic/advantages/max", "critic/returns/min",
        "response_length/mean", "response_length/clip_ratio", "prompt_length/mean", "timing_s/step", "timing_s/gen",
        "timing_s/reward", "timing_s/ref", "timing_s/update_actor", "timing_s/update_weights",
        "perf/total_num_tokens", "perf/time_per_step", "perf/throughput", "training/rollout_probs_diff_max",
        "perf/cpu_memory_used_gb", "perf/gen_tokens_per_s", "timing_per_token_ms/gen", "timing_per_token_ms/ref",
        "timing_per_token_ms/update_actor",
    ):  # fmt: skip
        assert key in metrics[0], key
    # prompts tagged RAISE make the reward function raise: scored 0, counted, never fatal
    assert sum(m["reward/errors"] for m in metrics) > 0
    # same model code and fp32 in rollout and trainer: probabilities agree to float error
    assert metrics[0]["training/rollout_probs_diff_max"] < 1e-4
    # where each step's generation went: the engine's runs since the last batch, and their seconds
    for m in metrics:
        assert m["perf/gen_prefill_runs"] >= 1 and m["perf/gen_decode_runs"] >= 1
        # a run of up to decode_steps steps; every response here is longer than one token
        assert m["perf/gen_decode_runs"] <= m["perf/gen_decode_steps"] <= m["response_length/max"]
        assert m["timing_s/gen_prefill"] > 0 and m["timing_s/gen_decode"] > 0
        assert m["timing_s/gen_graph_capture"] == 0  # (CPU: no graphs)


def _weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_resume_gives_exactly_the_uninterrupted_run(setup, tmp_path):
    steps = [
        "trainer.total_training_steps=4",
        "trainer.save_freq=2",
        "algorithm.adv_estimator=gae",
        "critic.optim.lr=1e-3",
    ]
    straight = RLTrainer(config(setup, tmp_path / "a", *steps))
    straight.fit()
    cut = RLTrainer(config(setup, tmp_path / "b", *steps[1:], "trainer.total_training_steps=2"))
    cut.fit()
    resumed = RLTrainer(config(setup, tmp_path / "b", *steps))
    assert resumed.step == 2
    resumed.fit()
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    for ma, mb in zip(a, b):
        same = {
            k: v
            for k, v in ma.items()
            if not k.startswith(
                ("timing", "perf/throughput", "perf/time", "perf/cpu", "perf/gen", "reward/latency")
            )
        }
        assert same == {k: mb[k] for k in same}
    wa, wb = _weights(straight.workers.worker.actor.model), _weights(resumed.workers.worker.actor.model)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_save_freq_means_what_it_means_in_verl(setup, tmp_path, capsys):
    """N: a checkpoint every N steps and after the last; 0 or -1 (verl's default, and what its scripts set
    to save nothing): none, said when the run starts and when a signal stops it; unset: the last only."""
    every_two = RLTrainer(
        config(setup, tmp_path / "two", "trainer.total_training_steps=3", "trainer.save_freq=2",
               "trainer.keep_last_checkpoints=3")
    )  # fmt: skip
    every_two.fit()
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == [
        "global_step_2",
        "global_step_3",
    ]
    capsys.readouterr()
    never = RLTrainer(
        config(setup, tmp_path / "never", "trainer.total_training_steps=2", "trainer.save_freq=-1")
    )
    never.fit()
    assert not (tmp_path / "never" / "checkpoints").exists() and never.last_checkpoint is None
    assert "no checkpoints (trainer.save_freq 0 or -1, verl's 'never')" in capsys.readouterr().out
    stop_with_checkpoint(never, "SIGTERM", saves=False)  # a signal saves nothing either
    assert (
        "no checkpoint written" in capsys.readouterr().out
        and not (tmp_path / "never" / "checkpoints").exists()
    )
    table = {(None, 1, False): False, (None, 3, True): True, (2, 2, False): True, (2, 3, False): False,
             (2, 3, True): True, (0, 3, True): False, (-1, 3, True): False}  # fmt: skip
    assert {key: due(*key) for key in table} == table
    with pytest.raises(UserError, match=r"trainer.max_restarts=1 .* trainer.save_freq=0 writes none"):
        RLTrainer(config(setup, tmp_path / "restarts", "trainer.save_freq=0", "trainer.max_restarts=1"))


def test_checkpoint_policy_reloads_in_transformers_with_identical_logits(setup, tmp_path):
    """The transformers actor path (model.impl=hf): the checkpoint is the trained module itself."""
    trainer = RLTrainer(config(setup, tmp_path / "run", "model.impl=hf", "trainer.total_training_steps=2"))
    trainer.fit()
    exported = AutoModelForCausalLM.from_pretrained(
        tmp_path / "run" / "checkpoints" / "global_step_2" / "policy"
    )
    ids = torch.tensor([[104, 105, 106, 107]])
    model = trainer.workers.worker.actor.model.cpu()  # compare on one device: kernels differ across devices
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, model(ids).logits)


def test_batch_sizes_that_do_not_divide_are_rejected_with_the_arithmetic(setup, tmp_path):
    with pytest.raises(
        UserError,
        match=r"actor.sequences_per_update=12 does not divide the 32 sequences of a step \(data.prompts_per_step=8 x rollout.samples_per_prompt=4\)",
    ):
        RLTrainer(config(setup, tmp_path / "run", "actor.sequences_per_update=12"))


def test_unknown_estimator_and_unscored_data_source(setup, tmp_path):
    with pytest.raises(
        UserError, match="algorithm.adv_estimator='grpoo' is unknown \\(did you mean 'grpo'\\?\\)"
    ):
        RLTrainer(config(setup, tmp_path / "run", "algorithm.adv_estimator=grpoo"))
    with pytest.raises(UserError, match="no reward scorer for data_source 'synthetic'"):
        RLTrainer(config(setup, tmp_path / "run2", "reward.custom_function_path=null"))


def test_a_run_started_inside_a_spawned_worker_is_refused(setup, tmp_path, monkeypatch):
    """A spawned reward worker re-imports the user's script as __mp_main__: a script that trains at
    import must not start a second run there (over the first one's directory)."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    monkeypatch.setattr(sys.modules["__main__"], "__name__", "__mp_main__")
    with pytest.raises(UserError, match='started inside a worker process.*if __name__ == "__main__":'):
        RLTrainer(config(setup, tmp_path / "run"), overwrite=True)
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == "{}\n"  # not cleared


def test_run_dir_with_foreign_files_is_refused(setup, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.md").write_text("mine")
    with pytest.raises(UserError, match="holds files this trainer did not write"):
        RLTrainer(config(setup, tmp_path / "run"))
    assert (tmp_path / "run" / "notes.md").read_text() == "mine"


def test_a_checkpoint_the_disk_cannot_hold_stops_before_writing(setup, tmp_path, monkeypatch):
    import shutil

    from hybridflow import checkpoint

    trainer = RLTrainer(config(setup, tmp_path / "run", "trainer.total_training_steps=1"))
    params = sum(p.numel() for p in trainer.workers.worker.actor.model.parameters())
    # fp32 weights and two Adam moments per parameter, plus the fp32 export
    assert trainer.workers.call("checkpoint_bytes") == [params * (4 + 8 + 4)]
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: usage._replace(free=1000))
    with pytest.raises(UserError, match=r"global_step_1 needs about .* MB in .* but only .* are free"):
        trainer.fit()
    assert not list((tmp_path / "run" / "checkpoints").iterdir())  # nothing half-written
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1]  # the step is still on record


@pytest.mark.parametrize("mode", ["off", "one_step"])
def test_exploding_learning_rate_stops_with_a_diagnosis(setup, tmp_path, mode):
    trainer = RLTrainer(
        config(
            setup,
            tmp_path / "run",
            "actor.optim.lr=1e12",
            "actor.optim.grad_clip=1e30",
            "trainer.total_training_steps=8",
            f"trainer.async_mode={mode}",
        )
    )
    with pytest.raises(
        TrainingDiverged,
        match=r"not finite.*actor.optim.lr=1e\+?12 too high\?\); no checkpoint was saved yet",
    ):
        trainer.fit()


def test_finished_run_resumes_to_nothing_and_overwrite_starts_over(setup, tmp_path, capsys):
    RLTrainer(config(setup, tmp_path / "run", "trainer.total_training_steps=1")).fit()
    again = RLTrainer(config(setup, tmp_path / "run", "trainer.total_training_steps=1"))
    assert again.step == 1
    again.fit()
    assert (
        "already finished 1 steps: nothing to train. To start over pass --overwrite"
        in capsys.readouterr().out
    )
    fresh = RLTrainer(config(setup, tmp_path / "run", "trainer.total_training_steps=1"), overwrite=True)
    assert fresh.step == 0 and not (tmp_path / "run" / "checkpoints").exists()
    with pytest.raises(UserError, match="is not empty and trainer.resume=disable"):
        RLTrainer(config(setup, tmp_path / "run", "trainer.resume=disable", "trainer.total_training_steps=1"))


def test_critic_from_a_path(setup, tmp_path):
    trainer = RLTrainer(
        config(
            setup,
            tmp_path / "run",
            "algorithm.adv_estimator=gae",
            f"critic.model_path={setup / 'model'}",
            "trainer.total_training_steps=1",
        )
    )
    assert type(trainer.workers.worker.critic.model).__name__ == "NativeScoreModel"
    metrics = trainer.fit()
    assert "critic/vf_loss" in metrics and "critic/values/mean" in metrics
    # the saved critic is a transformers token-classification checkpoint with the trained weights
    saved = AutoModelForTokenClassification.from_pretrained(
        tmp_path / "run" / "checkpoints" / "global_step_1" / "critic"
    )
    trained = trainer.workers.worker.critic.model.cpu().state_dict()
    assert all(torch.equal(trained[k], v) for k, v in saved.state_dict().items())


def test_dapo_step_without_informative_groups_trains_on_nothing(setup, tmp_path):
    (tmp_path / "constant.py").write_text("def compute_score(*args):\n    return 1.0\n")
    metrics = RLTrainer(
        config(
            setup,
            tmp_path / "run",
            "algorithm.filter_groups.enable=true",
            "algorithm.filter_groups.max_generation_rounds=2",
            f"reward.custom_function_path={tmp_path / 'constant.py'}",
            "trainer.total_training_steps=1",
        )
    ).fit()
    assert metrics["dapo/kept_groups"] == 0 and metrics["dapo/generation_rounds"] == 2
    assert metrics["critic/advantages/max"] == 0 and metrics["actor/grad_norm"] == 0


def test_native_model_trains_resumes_and_exports(setup, tmp_path):
    """model.impl=native: the actor and reference run our packed model, the rollout a synced copy."""
    steps = ["model.impl=native", "actor.use_kl_loss=true", "trainer.save_freq=2"]
    trainer = RLTrainer(config(setup, tmp_path / "a", *steps))
    assert type(trainer.workers.worker.actor.model).__name__ == "NativeCausalLM"
    trainer.fit()
    scores = [m["critic/score/mean"] for m in read_metrics(tmp_path / "a")]
    assert sum(scores[-4:]) / 4 > sum(scores[:4]) / 4 + 0.25
    # rollout log-probs (transformers copy) and trainer log-probs (native) agree: weights stay synced
    assert all(m["training/rollout_probs_diff_max"] < 1e-4 for m in read_metrics(tmp_path / "a"))
    exported = AutoModelForCausalLM.from_pretrained(
        tmp_path / "a" / "checkpoints" / "global_step_20" / "policy"
    )
    native = trainer.workers.worker.actor.model.cpu()
    for name, param in native.named_parameters():
        assert torch.equal(exported.state_dict()[name], param.detach()), name

    cut = RLTrainer(config(setup, tmp_path / "b", *steps, "trainer.total_training_steps=2"))
    cut.fit()
    resumed = RLTrainer(config(setup, tmp_path / "b", *steps, "trainer.total_training_steps=4"))
    resumed.fit()
    straight = read_metrics(tmp_path / "a")[:4]
    for ma, mb in zip(straight, read_metrics(tmp_path / "b")):
        assert (
            ma["critic/score/mean"] == mb["critic/score/mean"] and ma["actor/pg_loss"] == mb["actor/pg_loss"]
        )


def test_unsupported_family_trains_with_transformers_and_says_so(setup, tmp_path, capsys):
    from transformers import AutoConfig

    config_ = AutoConfig.for_model("gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=300, n_positions=256)
    torch.manual_seed(0)
    save_hf(AutoModelForCausalLM.from_config(config_), byte_tokenizer(), tmp_path / "gpt2")
    trainer = RLTrainer(
        config(
            setup,
            tmp_path / "run",
            f"model.path={tmp_path / 'gpt2'}",
            "algorithm.adv_estimator=gae",
            "trainer.total_training_steps=2",
        )
    )
    assert (
        "model type 'gpt2' has no native implementation: training it with transformers"
        in capsys.readouterr().out
    )
    assert type(trainer.workers.worker.actor.model).__name__ == "GPT2LMHeadModel"
    metrics = trainer.fit()
    assert metrics["actor/grad_norm"] > 0 and "critic/vf_loss" in metrics
    with pytest.raises(UserError, match="model.impl=native: model type 'gpt2' has no native implementation"):
        RLTrainer(config(setup, tmp_path / "run2", f"model.path={tmp_path / 'gpt2'}", "model.impl=native"))
