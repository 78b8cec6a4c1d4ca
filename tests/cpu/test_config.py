import pytest

from hybridflow.config import load_config, to_yaml
from hybridflow.errors import UserError


def test_defaults_live_in_dataclasses():
    c = load_config()
    assert c.model.path == "default"
    assert c.rollout.samples_per_prompt == 4
    assert c.actor.optim.lr == 1e-6
    assert c.trainer.run_dir == "runs/run"  # interpolated from experiment_name


def test_yaml_then_overrides(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data:\n  prompts_per_step: 16\nactor:\n  optim:\n    lr: 3.0e-6\n")
    c = load_config(str(recipe), ["actor.optim.lr=1e-5", "trainer.experiment_name=exp"])
    assert c.data.prompts_per_step == 16
    assert c.actor.optim.lr == 1e-5  # the override wins
    assert c.trainer.run_dir == "runs/exp"


def test_overrides_of_a_mapping_add_entries_to_the_recipes(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data:\n  task: arithmetic\n  task_options: {max_digits: 2, train_size: 100}\n")
    c = load_config(str(recipe), ["data.task_options.train_size=500", "data.task_options.seed=3"])
    assert c.data.task_options == {"max_digits": 2, "train_size": 500, "seed": 3}


def test_verl_aliases_rename_and_convert_units(tmp_path):
    recipe = tmp_path / "verl.yaml"
    recipe.write_text(
        "actor_rollout_ref:\n"
        "  model: {path: /models/x}\n"
        "  rollout: {n: 8, temperature: 0.6, name: hf}\n"
        "  actor: {ppo_mini_batch_size: 4, optim: {lr: 2.0e-6}, use_kl_loss: true, clip_ratio: 0.28}\n"
        "data: {train_batch_size: 32, max_prompt_length: 256, max_response_length: 1024}\n"
        "trainer: {default_local_dir: /tmp/run, logger: [console, file], n_gpus_per_node: 8}\n"
    )
    c = load_config(str(recipe), ["train.total_training_steps=7"])
    assert c.model.path == "/models/x"
    assert c.rollout.samples_per_prompt == 8
    assert c.rollout.temperature == 0.6
    # verl's mini-batch counts prompts and is multiplied by n: 4 prompts x 8 samples = 32 sequences
    assert c.actor.sequences_per_update == 32
    assert c.actor.optim.lr == 2e-6 and c.actor.use_kl_loss
    assert c.actor.clip_ratio_low == c.actor.clip_ratio_high == 0.28
    assert (c.data.prompts_per_step, c.data.max_prompt_tokens, c.data.max_response_tokens) == (32, 256, 1024)
    assert c.trainer.run_dir == "/tmp/run"
    assert c.trainer.logger == ["console", "jsonl"]
    assert c.resources.n_gpus_per_node == 8
    assert c.trainer.total_training_steps == 7


def test_mini_batch_alias_uses_final_n_whatever_the_order():
    c = load_config(None, ["actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=5"])
    assert c.actor.sequences_per_update == 10


@pytest.mark.parametrize(
    "override, message",
    [
        ("actor.optim.lrr=1", "'actor.optim.lrr' is not a config key (did you mean 'actor.optim.lr'?)"),
        ("data.train_batch_sz=3", "did you mean 'data.train_batch_size'?"),
        (
            "actor.optim.lr=abc",
            "config actor.optim.lr: Value 'abc' of type 'str' could not be converted to Float",
        ),
        ("data.prompts_per_step=many", "config data.prompts_per_step"),
        ("rollout.backend=sglang", "rollout.backend='sglang' is not one of auto, native, hf, vllm"),
        ("data.max_prompt_tokens=0", "data.max_prompt_tokens=0 must be > 0"),
        ("rollout.server_api_processes=0", "rollout.server_api_processes=0 must be > 0"),
        ("novalue", "must look like key=value"),
    ],
)
def test_bad_keys_and_values_name_the_culprit(override, message):
    with pytest.raises(UserError) as e:
        load_config(None, [override])
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_and_broken_recipes(tmp_path):
    with pytest.raises(UserError, match="recipe file not found: nope.yaml"):
        load_config("nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [unclosed\n")
    with pytest.raises(UserError, match="cannot parse recipe"):
        load_config(str(bad))
    bad.write_text("data:\n  nope: 1\n")
    with pytest.raises(UserError, match="'data.nope' is not a config key"):
        load_config(str(bad))


def test_yaml_round_trip(tmp_path):
    c = load_config(None, ["rollout.samples_per_prompt=3"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(c))
    assert load_config(str(path)) == c


def test_docs_table_lists_every_alias():
    from pathlib import Path

    from hybridflow.config.aliases import all_alias_keys, markdown_table

    doc = (Path(__file__).parents[2] / "docs" / "config.md").read_text()
    missing = [k for k in all_alias_keys() if f"`{k}`" not in doc]
    assert not missing, f"docs/config.md lacks {missing}"
    assert markdown_table() in doc, "docs/config.md's table is not aliases.markdown_table() as rendered now"


@pytest.mark.parametrize(
    "recipe",
    [
        "demo_arithmetic_grpo",
        "gsm8k_grpo",
        "gsm8k_ppo",
        "countdown_dapo",
        "tool_arithmetic_grpo",
        "guess_game_grpo",
    ],
)
def test_built_in_recipes_load_and_pass_start_checks(recipe):
    from hybridflow.controller.setup import check_config

    check_config(load_config(recipe))


def test_agent_settings_are_checked_at_load():
    with pytest.raises(
        UserError,
        match=r"rollout.agent.loop=tools \(verl: multi_turn.enable=True\) needs rollout.agent.tools",
    ):
        load_config(None, ["rollout.agent.loop=tools"])
    with pytest.raises(UserError, match="rollout.agent.loop='tool' is not one of"):
        load_config(None, ["rollout.agent.loop=tool"])
    from hybridflow.controller.setup import check_config

    with pytest.raises(UserError, match="set rollout.backend=native"):
        check_config(load_config("tool_arithmetic_grpo", ["rollout.backend=hf"]))
    # an environment scores every episode: a reward function the user named would never run
    with pytest.raises(
        UserError,
        match="reward.custom_function_path=r.py: the environment's rewards score every episode, so the function would never",
    ):
        check_config(load_config("guess_game_grpo", ["reward.custom_function_path=r.py"]))


def test_python_api_exports():
    import hybridflow

    assert hybridflow.RLTrainer.__name__ == "RLTrainer"
    assert hybridflow.load_config().model.path == "default"


ISSUE_VERL_KEYS = {
    "actor_rollout_ref.model.path": "/m",
    "actor_rollout_ref.rollout.n": 2,
    "actor_rollout_ref.rollout.temperature": 0.5,
    "actor_rollout_ref.rollout.gpu_memory_utilization": 0.6,
    "actor_rollout_ref.actor.optim.lr": 1e-5,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2,
    "actor_rollout_ref.actor.use_kl_loss": True,
    "actor_rollout_ref.actor.kl_loss_coef": 0.01,
    "actor_rollout_ref.actor.kl_loss_type": "k2",
    "actor_rollout_ref.actor.entropy_coeff": 0.001,
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 2,
    "actor_rollout_ref.model.use_remove_padding": True,
    "actor_rollout_ref.model.enable_gradient_checkpointing": True,
    "data.train_files": ["a.parquet"],
    "data.val_files": ["b.parquet"],
    "data.train_batch_size": 16,
    "data.max_prompt_length": 100,
    "data.max_response_length": 200,
    "algorithm.adv_estimator": "rloo",
    "algorithm.kl_ctrl.kl_coef": 0.02,
    "algorithm.use_kl_in_reward": True,
    "trainer.total_training_steps": 9,
    "trainer.total_epochs": 3,
    "trainer.save_freq": 5,
    "trainer.test_freq": 4,
    "trainer.logger": ["console"],
    "trainer.n_gpus_per_node": 2,
    "trainer.nnodes": 3,
    "trainer.default_local_dir": "/tmp/r",
    "trainer.resume_mode": "disable",
    "trainer.val_before_train": False,
    "trainer.project_name": "p",
    "trainer.experiment_name": "e",
    "trainer.seed": 7,
    "actor_rollout_ref.rollout.name": "hf",
    "custom_reward_function.path": "/r.py",
    "custom_reward_function.name": "fn",
}


def test_every_verl_key_from_the_issue_is_accepted():
    import json

    c = load_config(None, [f"{k}={json.dumps(v)}" for k, v in ISSUE_VERL_KEYS.items()])
    assert (c.model.path, c.rollout.samples_per_prompt, c.rollout.gpu_memory_utilization) == ("/m", 2, 0.6)
    assert (c.actor.sequences_per_update, c.actor.sequences_per_microbatch, c.actor.kl_loss_type) == (
        8,
        2,
        "k2",
    )
    assert (c.actor.sequence_parallel_size, c.model.enable_gradient_checkpointing) == (2, True)
    assert (c.data.prompts_per_step, c.data.max_prompt_tokens, c.data.max_response_tokens) == (16, 100, 200)
    assert (c.algorithm.adv_estimator, c.algorithm.kl_ctrl.kl_coef, c.algorithm.use_kl_in_reward) == (
        "rloo",
        0.02,
        True,
    )
    assert (c.resources.n_gpus_per_node, c.resources.nnodes, c.trainer.run_dir, c.trainer.resume) == (
        2,
        3,
        "/tmp/r",
        "disable",
    )
    assert (
        c.trainer.seed,
        c.rollout.backend,
        c.reward.custom_function_path,
        c.reward.custom_function_name,
    ) == (7, "hf", "/r.py", "fn")


def _sections(cls, seen=None):
    import dataclasses
    import typing

    seen = seen if seen is not None else []
    seen.append(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]) and hints[f.name] not in seen:
            _sections(hints[f.name], seen)
    return seen


def test_every_config_field_says_what_it_does():
    import dataclasses

    from hybridflow.config import Config
    from hybridflow.config.explain import field_docs

    missing = [f"{cls.__name__}.{f.name}" for cls in _sections(Config) for f in dataclasses.fields(cls)
               if not field_docs(cls).get(f.name)]  # fmt: skip
    assert not missing, f"fields without a docstring: {missing}"


def test_config_show_explain_prints_values_defaults_and_descriptions(capsys):
    from hybridflow.cli import main

    assert main(["config", "show", "gsm8k_grpo", "--explain", "actor.kl_loss_type"]) == 0
    out = capsys.readouterr().out
    assert "actor.kl_loss_type = 'low_var_kl'" in out and "Its estimator" in out
    assert main(["config", "show", "--explain", "actor.optim"]) == 0
    out = capsys.readouterr().out
    assert "actor.optim.lr = " in out and "Peak learning rate of AdamW." in out
    assert main(["config", "show", "--explain", "actor_rollout_ref.rollout.n"]) == 0
    assert "-> `rollout.samples_per_prompt`" in capsys.readouterr().out
    assert main(["config", "show", "--explain", "actor.polcy_loss"]) != 0
    assert "did you mean 'actor.policy_loss'" in capsys.readouterr().err
