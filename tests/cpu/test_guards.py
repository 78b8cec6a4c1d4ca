"""The default-on guards: each trips on the wrong numbers with a line naming them, stays quiet on
right ones, and the weight-sync check compares real engines with real trainers (LoRA included)."""

import logging

import pytest
import torch
from rl_run import config, read_metrics

from hybridflow.config.schema import GuardsConfig
from hybridflow.controller.guards import GuardTripped, TrainingGuards
from hybridflow.engine import Engine, EngineConfig
from hybridflow.models import tiny_model
from hybridflow.models.lora import apply_lora, lora_modules, merged_updates
from hybridflow.models.native import from_hf_model
from hybridflow.parallel.weight_check import WeightSyncMismatch, compare, make_plan, sample, trainer_tensors


def engine_for(model, dtype="bfloat16"):
    return Engine(
        model, eos_token_ids=[0], config=EngineConfig(page_size=4, compute_dtype=dtype, max_context_tokens=64)
    )


def test_weights_synced_agree_and_a_stale_tensor_is_named():
    """A bf16 engine keeps its own copy (fp32 on CPU shares the trainer's tensors: never stale)."""
    model = from_hf_model(tiny_model("qwen2", seed=0))
    engine = engine_for(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # an update the engine has not had yet
    tensors = trainer_tensors(model)
    plan = make_plan(tensors, step=3)
    assert len(plan) == 4 and len({n for n, _ in plan}) == 4
    with pytest.raises(
        WeightSyncMismatch, match=r"step 3: after the weight sync engine's .* differs from the trainer's"
    ):
        compare(sample(tensors, plan), sample(engine.weight_tensors(), plan), step=3, where="engine")
    engine.update_weights(model.named_parameters())
    for step in range(1, 40):  # every tensor is sampled at some step; each agrees exactly after a sync
        plan = make_plan(tensors, step)
        compare(sample(tensors, plan), sample(engine.weight_tensors(), plan), step=step, where="engine")
    name = plan[0][0]
    with torch.no_grad():  # one element of one tensor left behind is found when that tensor is sampled
        engine.weight_tensors()[name].view(-1)[plan[0][1][0]] += 1.0
    with pytest.raises(WeightSyncMismatch, match=name.replace(".", r"\.")):
        compare(sample(tensors, plan), sample(engine.weight_tensors(), plan), step=39, where="engine")


def test_lora_checks_the_merged_adapted_layers_in_the_engine():
    model = from_hf_model(tiny_model("llama", seed=0))
    engine = engine_for(model)
    apply_lora(model, rank=4, alpha=8, targets=["q_proj", "v_proj"])
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.normal_()  # trained adapters: the merged weight differs from the base
    tensors = trainer_tensors(model)
    assert set(tensors) == {f"{n}.weight" for n in lora_modules(model)}
    plan = make_plan(tensors, step=1)
    with pytest.raises(WeightSyncMismatch):  # the engine still has the base weights
        compare(sample(tensors, plan), sample(engine.weight_tensors(), plan), step=1, where="engine")
    engine.update_weights(merged_updates(model))
    compare(sample(tensors, plan), sample(engine.weight_tensors(), plan), step=1, where="engine")


def test_a_probability_gap_above_the_bound_stops_naming_it():
    guards = TrainingGuards(GuardsConfig())
    guards.check(1, {"training/rollout_probs_diff_mean": 0.004, "training/rollout_probs_diff_max": 0.2})
    with pytest.raises(
        GuardTripped, match=r"step 2: .* differ from the trainer's by 0\.2100 on average.*max_probs_gap=0\.1"
    ):
        guards.check(2, {"training/rollout_probs_diff_mean": 0.21, "training/rollout_probs_diff_max": 0.9})
    TrainingGuards(GuardsConfig(max_probs_gap=0)).check(2, {"training/rollout_probs_diff_mean": 0.21})  # off


def test_a_first_mini_batch_that_moved_stops_naming_its_ppo_kl():
    guards = TrainingGuards(GuardsConfig())
    guards.check(1, {"training/first_minibatch_ppo_kl": 2e-4})
    with pytest.raises(GuardTripped, match=r"first mini-batch's ppo_kl is -0\.03"):
        guards.check(2, {"training/first_minibatch_ppo_kl": -0.03})
    TrainingGuards(GuardsConfig(max_first_ppo_kl=0)).check(2, {"training/first_minibatch_ppo_kl": -0.03})


def test_a_growing_gap_is_warned_about_once_naming_the_step_it_began(caplog):
    guards = TrainingGuards(GuardsConfig())
    gaps = [2e-4, 3e-4, 2e-4, 2e-4, 3e-4, 2e-4, 3e-4, 2e-3, 4e-3, 9e-3, 2e-2, 3e-2]  # grows from step 8
    with caplog.at_level(logging.WARNING, logger="hybridflow.controller.guards"):
        for step, gap in enumerate(gaps, start=1):
            guards.check(step, {"training/rollout_probs_diff_mean": gap})
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "since step 8" in warnings[0] and "to 0.009" in warnings[0]
    quiet = TrainingGuards(GuardsConfig())
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hybridflow.controller.guards"):
        for step, gap in enumerate([2e-4, 3e-4, 2e-4, 2e-4, 3e-4] * 4, start=1):  # noise, no trend
            quiet.check(step, {"training/rollout_probs_diff_mean": gap})
    assert not caplog.records


def test_a_run_checks_every_sync_and_a_tripped_guard_ends_it_with_the_line(setup, tmp_path):
    from hybridflow.controller.trainer import RLTrainer

    trainer = RLTrainer(config(setup, tmp_path / "ok", "trainer.total_training_steps=3"))
    trainer.fit()
    metrics = read_metrics(tmp_path / "ok")
    assert all(m["timing_s/weight_check"] > 0 for m in metrics if m["step"] > 0)
    strict = config(
        setup, tmp_path / "strict", "trainer.total_training_steps=3", "trainer.guards.max_probs_gap=1e-12"
    )
    with pytest.raises(GuardTripped, match=r"^step 1: the rollout engine's token probabilities"):
        RLTrainer(strict).fit()
