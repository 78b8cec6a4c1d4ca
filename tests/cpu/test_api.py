"""The Python API: a live transformers model, a `datasets.Dataset` and a lambda reward train in three
lines; every trainer class runs; evaluate, save (a reloadable transformers directory) and a second
train() call that goes on; the config classes map their flat fields and presets."""

import json

import datasets
import pytest
import torch
from rl_run import read_metrics
from transformers import AutoModelForCausalLM

from hybridflow import (
    DAPOTrainer,
    GRPOConfig,
    GRPOTrainer,
    PPOConfig,
    PPOTrainer,
    ReinforcePPTrainer,
    RLOOTrainer,
)
from hybridflow.errors import UserError
from hybridflow.models import byte_tokenizer, tiny_model

SMALL = dict(prompts_per_step=4, samples_per_prompt=2, max_response_tokens=6, learning_rate=1e-3)
QUIET = {"logger": ["jsonl"], "progress": False}


def _dataset(n=16):
    return datasets.Dataset.from_list(
        [{"prompt": f"say a{i}", "target": "a" * (1 + i % 3), "data_source": "synthetic"} for i in range(n)]
    )


def test_quick_start_with_live_objects_trains_evaluates_saves_and_goes_on(tmp_path):
    model, tokenizer = tiny_model("qwen2", seed=0), byte_tokenizer()
    seen = {}

    def reward(prompts, responses, target, **columns):  # TRL-style: the dataset's other columns by name
        seen.update(prompt=prompts[0], columns=sorted(columns), target=target[0])
        # the first character's code varies within a group, so every step moves the policy
        return [float(r.count("a")) / max(len(r), 1) + (ord(r[0]) % 5 if r else 0) for r in responses]

    trainer = GRPOTrainer(
        model,
        tokenizer=tokenizer,
        train_dataset=_dataset(),
        eval_dataset=_dataset(4),
        reward_fn=reward,
        args=GRPOConfig(
            output_dir=str(tmp_path / "run"), **SMALL, actor={"compute_dtype": "float32"}, trainer=QUIET
        ),
    )
    with trainer:
        metrics = trainer.train(max_steps=2)
        assert trainer.step == 2 and metrics["rollout/responses"] == 8.0 and "critic/score/std" in metrics
        assert seen["prompt"].startswith("say a") and seen["columns"] == ["data_source"]
        assert seen["target"] in ("a", "aa", "aaa")
        assert "val-core/synthetic/reward/mean@1" in trainer.evaluate()  # no `acc` returned: verl's name
        trainer.train(max_steps=3)  # goes on from step 2
        assert trainer.step == 3
        saved = trainer.save(tmp_path / "export")
    assert [m["step"] for m in read_metrics(tmp_path / "run") if "critic/score/mean" in m] == [1, 2, 3]
    ids = torch.tensor([[5, 9, 17]])
    with torch.no_grad():  # the export holds the trained policy; the live model given is left as it was
        trained, start = AutoModelForCausalLM.from_pretrained(saved)(ids).logits, model(ids).logits
    assert trained.shape == start.shape and not torch.allclose(trained, start)
    assert (tmp_path / "run" / "inputs" / "actor" / "model.safetensors").is_file()


@pytest.mark.parametrize("cls", [PPOTrainer, DAPOTrainer, RLOOTrainer, ReinforcePPTrainer])
def test_every_trainer_class_runs_two_steps(tmp_path, cls):
    trainer = cls(
        tiny_model("qwen2", seed=0),
        tokenizer=byte_tokenizer(),
        train_dataset=[{"prompt": f"q{i}"} for i in range(16)],
        reward_fn=lambda prompts, responses, **_: [r.count("a") / max(len(r), 1) for r in responses],
        args=GRPOConfig(output_dir=str(tmp_path), **SMALL, trainer=QUIET),  # the class picks the algorithm
    )
    with trainer:
        trainer.train(max_steps=2)
    rows = [m for m in read_metrics(tmp_path) if "critic/score/mean" in m]
    assert [m["step"] for m in rows] == [1, 2]
    estimator = {
        PPOTrainer: "gae",
        DAPOTrainer: "grpo",
        RLOOTrainer: "rloo",
        ReinforcePPTrainer: "reinforce_plus_plus",
    }
    assert trainer.config.algorithm.adv_estimator == estimator[cls]
    if cls is PPOTrainer:
        assert "critic/vf_loss" in rows[-1]


def test_verl_signature_and_data_files_pass_through(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"q{i}", "data_source": "x"}) for i in range(8)))
    calls = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        calls.append((data_source, "row" in (extra_info or {})))
        return 1.0

    trainer = GRPOTrainer(
        tiny_model("qwen2", seed=0), tokenizer=byte_tokenizer(), train_dataset=str(data), reward_fn=compute_score,
        args=GRPOConfig(output_dir=str(tmp_path / "run"), **SMALL, trainer=QUIET),
    )  # fmt: skip
    assert trainer.config.data.train_files == [str(data)]  # a path is read in place
    with trainer:
        trainer.train(max_steps=1)
    assert calls and all(c == ("x", False) for c in calls)


def test_config_classes_map_flat_fields_and_sections():
    c = GRPOConfig(prompts_per_step=16, samples_per_prompt=8, max_prompt_tokens=100, max_response_tokens=50,
                   learning_rate=3e-6, kl_coef=0.02, seed=7, max_steps=9, actor={"clip_ratio_high": 0.28},
                   overrides=["trainer.save_freq=5"]).to_config()  # fmt: skip
    assert (c.data.prompts_per_step, c.rollout.samples_per_prompt, c.data.max_prompt_tokens) == (16, 8, 100)
    assert (c.data.max_response_tokens, c.actor.optim.lr, c.trainer.seed) == (50, 3e-6, 7)
    assert c.actor.use_kl_loss and c.actor.kl_loss_coef == 0.02 and not c.algorithm.use_kl_in_reward
    assert (c.trainer.total_training_steps, c.actor.clip_ratio_high, c.trainer.save_freq) == (9, 0.28, 5)
    assert GRPOConfig(lora_rank=8).to_config().model.lora_rank == 8
    p = PPOConfig(kl_coef=0.0).to_config()
    assert p.algorithm.adv_estimator == "gae" and not p.algorithm.use_kl_in_reward
    with pytest.raises(UserError, match="actor.clip_ratio_hgh"):
        GRPOConfig(actor={"clip_ratio_hgh": 0.3}).to_config()


def test_misplaced_models_and_missing_tokenizer_are_named(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), **SMALL, trainer=QUIET)
    model = tiny_model("qwen2", seed=0)
    with pytest.raises(UserError, match="pass its tokenizer"):
        GRPOTrainer(model, train_dataset=_dataset(), args=args)
    with pytest.raises(UserError, match="no KL term is on"):
        GRPOTrainer(model, tokenizer=byte_tokenizer(), ref_model=model, train_dataset=_dataset(), args=args)
    with pytest.raises(UserError, match="trains no critic"):
        GRPOTrainer(
            model, tokenizer=byte_tokenizer(), critic_model=model, train_dataset=_dataset(), args=args
        )
    with pytest.raises(UserError, match="row 1 is a str"):
        GRPOTrainer(model, tokenizer=byte_tokenizer(), train_dataset=[{"prompt": "a"}, "b"],
                    reward_fn=lambda p, r: [0.0] * len(r), args=args)  # fmt: skip


def test_a_script_without_a_main_guard_runs_once_with_scoring_workers(setup, tmp_path):
    """TRL's quick starts have no `if __name__ == "__main__":`. The scoring workers are children
    started by module name, so the script is not run again in each of them (multiprocessing's spawn
    re-imported it: a second run, a stray run directory, two tracebacks)."""
    import subprocess
    import sys

    script = tmp_path / "quick_start.py"
    script.write_text(
        "from hybridflow import GRPOConfig, GRPOTrainer\n"
        "print('SCRIPT RUNS', flush=True)\n"
        f"trainer = GRPOTrainer(model={str(setup / 'model')!r}, reward_funcs={str(setup / 'reward.py')!r},\n"
        f"    train_dataset={str(setup / 'prompts.jsonl')!r}, args=GRPOConfig(output_dir='run', max_steps=1,\n"
        "    num_generations=2, max_completion_length=6, per_device_train_batch_size=4, reward={'num_workers': 2}))\n"
        "trainer.train()\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("SCRIPT RUNS") == 1 and "[step 1]" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quick_start.py", "run"]
