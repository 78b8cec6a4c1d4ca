"""Other projects' material run as written on the embedded SmolLM2-135M-Instruct, 1-2 tiny steps each:
verl's quickstart command on data in verl's GSM8K preprocessing schema with a verl `compute_score`
file returning a dict, TRL's GRPOTrainer quick start with TRL's names, a conversational dataset and
two weighted TRL reward functions, and the tutorials' `PPOTrainer(actor_model, critic_model,
tokenizer, dataset, config, reward_fn)`. Each asserts the config that ran (algorithm, samples, steps,
critic) and that rewards are non-zero where they should be.

Where we differ on purpose: the quickstart's `rollout.name=vllm` is refused without vLLM (the test
runs it so, then with our engine), its hub ids are replaced by the embedded model (no hub here)."""

import json
import shlex

import pytest
from test_verl_keys import QUICKSTART, words

from hybridflow.cli import main
from hybridflow.data.files import write_rows

pytestmark = pytest.mark.slow

QUESTIONS = [
    ("Natalia sold 48 clips in April and half as many in May. How many clips did she sell?", "72"),
    ("Weng earns $12 an hour. She did 50 minutes of babysitting. How much did she earn?", "10"),
    ("Betty needs $100. She has half of it. How much more does she need?", "50"),
    ("James writes a 3-page letter to 2 friends twice a week. How many pages a week?", "12"),
]
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

# a verl compute_score file: a dict with the score, an acc, and a metric of its own
VERL_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    assert data_source == "openai/gsm8k" and extra_info["split"] in ("train", "test")
    letters = sum(ch.isalpha() for ch in solution_str)
    return {"score": 1.0 + letters / 100, "acc": float(ground_truth in solution_str), "letters": letters}
"""


def gsm8k_rows(split):
    """Rows as verl's examples/data_preprocess/gsm8k.py writes them."""
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{q} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": a},
            "extra_info": {"split": split, "index": i, "answer": f"... #### {a}", "question": q},
        }
        for i, (q, a) in enumerate(QUESTIONS)
    ]


def test_verl_quickstart_command(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write_rows(gsm8k_rows("train"), tmp_path / "train.parquet")
    write_rows(gsm8k_rows("test")[:2], tmp_path / "test.parquet")
    (tmp_path / "reward.py").write_text(VERL_REWARD)
    argv = words(QUICKSTART, DATA=str(tmp_path))
    # as written: vLLM is named before any work (this environment has none)
    assert main(["train", *argv]) == 2
    assert "vLLM is not installed" in capsys.readouterr().err
    sized = shlex.split(
        "actor_rollout_ref.rollout.name=native actor_rollout_ref.model.path=default critic.model.path=default "
        "data.train_batch_size=2 actor_rollout_ref.actor.ppo_mini_batch_size=2 data.max_response_length=8 "
        f"trainer.total_training_steps=1 custom_reward_function.path={tmp_path / 'reward.py'} "
        "trainer.val_before_train=True trainer.logger=[console,file]"
    )
    assert main(["train", *argv, *sized]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("config base: verl's defaults")
    run = tmp_path / "runs" / "gsm8k"  # verl's default experiment name
    ran = (run / "config.yaml").read_text()
    for line in ("adv_estimator: gae", "samples_per_prompt: 1", "total_epochs: 15", "model_path: default"):
        assert line in ran
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    step = rows[1]
    assert step["critic/score/mean"] > 1.0 and "critic/vf_loss" in step  # the dict's score; a critic trained
    assert step["reward/letters/mean"] > 0 and step["reward/errors"] == 0
    assert "val-core/openai/gsm8k/acc/mean@1" in rows[0]  # the function's acc, verl's name
    assert (run / "checkpoints" / "global_step_1").is_dir()


def test_trl_grpo_quick_start_with_a_conversational_dataset(tmp_path, monkeypatch, capsys):
    from datasets import Dataset

    from hybridflow import GRPOConfig, GRPOTrainer

    monkeypatch.chdir(tmp_path)
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": q}], "solution": a} for q, a in QUESTIONS]
    )
    seen = {}

    def reward_len(completions, **kwargs):  # TRL's quick start
        seen["completion"] = completions[0]
        return [-abs(20 - len(completion[0]["content"])) for completion in completions]

    def mentions_solution(completions, solution, **kwargs):
        return [float(s in c[0]["content"]) for c, s in zip(completions, solution)]

    args = GRPOConfig(
        output_dir=str(tmp_path / "Qwen2-0.5B-GRPO"),
        num_generations=4,
        max_completion_length=8,
        per_device_train_batch_size=8,
        max_steps=2,
        learning_rate=1e-6,
        reward_weights=[1.0, 0.5],
        report_to="none",
    )
    trainer = GRPOTrainer(
        model="default", reward_funcs=[reward_len, mentions_solution], args=args, train_dataset=dataset
    )
    metrics = trainer.train()
    trainer.close()
    c = trainer.config
    assert (c.algorithm.adv_estimator, c.rollout.samples_per_prompt, c.data.prompts_per_step) == (
        "grpo",
        4,
        2,
    )
    assert trainer.step == 2 and c.data.max_response_tokens == 8
    assert isinstance(seen["completion"], list) and seen["completion"][0]["role"] == "assistant"
    assert metrics["critic/score/mean"] < 0  # the length penalty, not a silent 0
    assert "reward/reward_len/mean" in metrics and "reward/mentions_solution/mean" in metrics
    assert metrics["reward/errors"] == 0


def test_tutorial_ppo_trainer_call(tmp_path, monkeypatch):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridflow import PPOConfig, PPOTrainer
    from hybridflow.models.default import default_model_dir

    monkeypatch.chdir(tmp_path)
    path = default_model_dir()
    actor_model = AutoModelForCausalLM.from_pretrained(path)
    critic_model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    dataset = Dataset.from_list([{"prompt": q} for q, _ in QUESTIONS[:2]])  # one step: two models' Adam saved
    config = PPOConfig(
        exp_name="ppo-tutorial",
        batch_size=2,
        mini_batch_size=2,
        ppo_epochs=1,
        kl_coef=0.05,
        cliprange_value=0.2,
        max_new_tokens=8,
        save_freq=1,
    )
    trainer = PPOTrainer(
        actor_model=actor_model,
        critic_model=critic_model,
        tokenizer=tokenizer,
        dataset=dataset,
        config=config,
        reward_fn=lambda prompts, responses: [float(len(r)) for r in responses],
    )
    metrics = trainer.train()
    trainer.close()
    c = trainer.config
    assert (c.algorithm.adv_estimator, c.rollout.samples_per_prompt, c.data.prompts_per_step) == ("gae", 1, 2)
    assert (c.algorithm.use_kl_in_reward, c.algorithm.kl_ctrl.kl_coef, c.critic.cliprange_value) == (
        True,
        0.05,
        0.2,
    )
    assert c.trainer.run_dir == "runs/ppo-tutorial" and c.trainer.save_freq == 1
    assert trainer.step == 1  # one epoch of 2 prompts, 2 a step
    assert metrics["critic/score/mean"] > 0 and "critic/vf_loss" in metrics
    assert (tmp_path / "runs" / "ppo-tutorial" / "checkpoints" / "global_step_1").is_dir()


def test_generate_one_prompt_one_sample_on_cpu(capsys):
    assert main(["generate", "--model", "default", "--prompt", "What is 17 + 25?", "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "--- prompt 0" in out and "generated" in out
