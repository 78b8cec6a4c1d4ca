"""The small RL run the trainer tests share: config over a tiny model and a synthetic reward."""

import json

from hybridflow.config import load_config

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Synthetic reward any working policy gradient can climb: the share of 'a' characters."""
    if "RAISE" in (extra_info or {}).get("tag", ""):
        raise RuntimeError("a buggy reward")
    return solution_str.count("a") / max(len(solution_str), 1)
'''


def config(setup, run_dir, *overrides):
    return load_config(None, arguments(setup, run_dir, *overrides))


def arguments(setup, run_dir, *overrides):
    """The run's overrides as `hybridflow train` takes them."""
    base = [
        f"model.path={setup / 'model'}",
        f"data.train_files=[{setup / 'prompts.jsonl'}]",
        "data.max_response_tokens=12",
        "data.prompts_per_step=8",
        "rollout.samples_per_prompt=4",
        "actor.optim.lr=1e-2",
        "actor.compute_dtype=float32",
        f"reward.custom_function_path={setup / 'reward.py'}",
        "reward.num_workers=0",
        "trainer.logger=[jsonl]",
        f"trainer.run_dir={run_dir}",
        "trainer.total_training_steps=20",
    ]
    return [*base, *overrides]


# wall-clock figures differ between any two runs; everything else repeats
CLOCKS = ("timing_s/", "timing_per_token_ms/", "perf/", "reward/latency")


def measured(rows):
    """Metrics rows without their clock figures."""
    return [
        {k: v for k, v in row.items() if not k.startswith(CLOCKS) and not k.endswith("_s")} for row in rows
    ]


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def whole_batch_fit(config):
    """The reference run of the one road: RLTrainer(config) with every step's prompts generated as one
    batch through the Rollout role (WholeBatches, the adapter whole-batch backends use) instead of the
    stream of groups that the native engine takes in every mode."""
    from hybridflow.controller.trainer import RLTrainer
    from hybridflow.stream.batches import WholeBatches

    trainer = RLTrainer(config)
    trainer.batches.close()
    trainer.batches = WholeBatches(
        config,
        trainer.placement,
        trainer.roles,
        trainer.reward,
        trainer.sampler,
        lambda n: trainer.watchdog.phase(n),
    )
    trainer.fit()
    return trainer
