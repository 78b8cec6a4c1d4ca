"""LoRA: adapters start as the identity, switch off to the base (the reference), merge exactly, and
round-trip through PEFT; an RL run with model.lora_rank trains only the adapters, keeps the rollout
engine's log-probs equal to the trainer's after every update, and exports merged or adapter-only."""

import pytest
import torch
from peft import PeftModel
from rl_run import config, read_metrics, whole_batch_fit
from safetensors.torch import load_file
from torch.distributed.fsdp import FSDPModule
from torch.testing import assert_close
from transformers import AutoModelForCausalLM

from hybridflow.batch import TrainingBatch, pad_ragged
from hybridflow.cli import main
from hybridflow.controller.role_models import lora_policy
from hybridflow.controller.trainer import RLTrainer
from hybridflow.errors import UserError
from hybridflow.models import native, tiny_model
from hybridflow.models.checkpoint_export import export_adapter, export_checkpoint
from hybridflow.models.lora import (
    adapters_disabled,
    apply_lora,
    load_adapter,
    lora_modules,
    merged_model,
    save_adapter,
    sequence_logits,
)
from hybridflow.roles.reference import Reference

IDS = torch.tensor([[5, 9, 200, 17, 3, 8, 44, 2]])


def _logits(model, ids=IDS):
    """[T, V] from a transformers model or ours."""
    with torch.no_grad():
        return (
            sequence_logits(model, ids[0]) if isinstance(model, native.NativeModule) else model(ids).logits[0]
        )


def _randomise_adapters(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    for m in lora_modules(model).values():
        m.lora_B.data = torch.randn(m.lora_B.shape, generator=g) * 0.05


def test_adapters_start_as_identity_switch_off_merge_and_round_trip_through_peft(tmp_path):
    hf = tiny_model("qwen2", seed=3)
    base = native.from_hf_model(hf)
    start = _logits(base)
    model = native.from_hf_model(hf)
    assert apply_lora(model, 4, 8.0, ["q_proj", "v_proj", "down_proj"]) == 3 * hf.config.num_hidden_layers
    assert_close(_logits(model), start, atol=1e-6, rtol=0)  # B = 0: the base at first
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    _randomise_adapters(model)
    tuned = _logits(model)
    assert not torch.allclose(tuned, start, atol=1e-3)
    with adapters_disabled(model):
        assert_close(_logits(model), start, atol=1e-6, rtol=0)
    assert_close(_logits(merged_model(model)), tuned, atol=1e-5, rtol=0)

    save_adapter(model, tmp_path / "adapter")
    peft = PeftModel.from_pretrained(tiny_model("qwen2", seed=3), tmp_path / "adapter").eval()
    assert_close(_logits(peft), tuned, atol=1e-5, rtol=0)  # PEFT reads our adapter as we do
    peft.save_pretrained(tmp_path / "from-peft")
    again = native.from_hf_model(tiny_model("qwen2", seed=3))
    apply_lora(again, 4, 8.0, ["q_proj", "v_proj", "down_proj"])
    load_adapter(again, tmp_path / "from-peft")  # and we read PEFT's
    assert_close(_logits(again), tuned, atol=1e-5, rtol=0)
    other = native.from_hf_model(tiny_model("qwen2", seed=3))
    apply_lora(other, 4, 8.0, ["q_proj"])
    with pytest.raises(UserError, match="adapts layers this model does not"):
        load_adapter(other, tmp_path / "adapter")


def _lora_run(setup, run, steps, *overrides, whole_batches=False):
    """A LoRA run with a KL loss (so a reference) and two updates a step (so the trainer recomputes
    the rollout's log-probs): its worker and step metrics, after checking what every LoRA run keeps."""
    c = config(setup, run, "actor.use_kl_loss=true", "actor.sequences_per_update=16",
               f"trainer.total_training_steps={steps}", *overrides)  # fmt: skip
    trainer = whole_batch_fit(c) if whole_batches else RLTrainer(c)
    if not whole_batches:
        trainer.fit()
    worker = trainer.workers.worker
    assert worker.ref.model is worker.actor.model  # the reference is the base with adapters off: no copy
    metrics = [m for m in read_metrics(run) if "actor/pg_loss" in m]
    assert len(metrics) == steps
    # the rollout (merged weights refreshed each step, or the same module) agrees with the trainer
    assert max(m["training/rollout_probs_diff_max"] for m in metrics) < 1e-4
    return worker, metrics


@pytest.mark.slow
def test_a_lora_run_trains_only_adapters_with_engine_parity_and_exports(setup, tmp_path):
    run = tmp_path / "lora"
    worker, metrics = _lora_run(
        setup, run, 4, "model.lora_rank=4", "model.lora_alpha=8", "actor.kl_loss_coef=0.1"
    )
    assert metrics[-1]["actor/kl_loss"] > 1e-6

    start = native.from_hf_model(AutoModelForCausalLM.from_pretrained(setup / "model"))
    trained = worker.actor.model
    batch = TrainingBatch([[5, 9, 17], [44, 2]], [[3, 8, 1], [7]], pad_ragged([[1.0] * 3, [1.0]]))
    base_ref = Reference(start, max_tokens_per_microbatch=64, compute_dtype="float32", pad_token_id=0)
    assert_close(
        worker.ref.log_probs(batch), base_ref.log_probs(batch), atol=1e-6, rtol=0
    )  # adapters off = base
    assert not torch.allclose(worker.actor.log_probs(batch)[0], base_ref.log_probs(batch), atol=1e-4)
    base_now = {n.replace(".base.", "."): p for n, p in trained.state_dict().items() if ".lora_" not in n}
    assert all(torch.equal(base_now[n], p) for n, p in start.state_dict().items())  # only adapters moved
    assert any(m.lora_B.abs().max() > 0 for m in lora_modules(trained).values())

    checkpoint = run / "checkpoints" / "global_step_4"
    assert (checkpoint / "policy_adapter" / "adapter_config.json").is_file()
    merged = export_checkpoint(run, tmp_path / "merged")  # checks its reload against the checkpoint
    assert merged.max_logit_diff <= 1e-5
    assert_close(
        _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "merged")),
        _logits(trained),
        atol=1e-5,
        rtol=0,
    )
    assert main(["export", str(run), "--out", str(tmp_path / "cli"), "--adapter-only"]) == 0
    assert (tmp_path / "cli" / "adapter_model.safetensors").is_file()
    adapter = export_adapter(run, tmp_path / "adapter")
    assert adapter.parameters == sum(p.numel() for n, p in trained.named_parameters() if ".lora_" in n)
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(setup / "model"), tmp_path / "adapter"
    )
    assert_close(_logits(peft.eval()), _logits(trained), atol=1e-5, rtol=0)

    # continue training from a PEFT adapter directory: the policy starts where the run ended
    resumed = config(setup, tmp_path / "again", f"model.lora_adapter_path={tmp_path / 'adapter'}")
    policy = lora_policy(resumed, native.from_hf_model(AutoModelForCausalLM.from_pretrained(setup / "model")))
    assert_close(_logits(policy), _logits(trained), atol=1e-5, rtol=0)
    with pytest.raises(UserError, match="no LoRA adapters"):
        export_adapter(setup_run_without_lora(setup, tmp_path), tmp_path / "none")


def test_lora_streams_and_at_staleness_0_is_its_synchronous_run(setup, tmp_path):
    """Asynchronous LoRA: the stream's weight update writes the merged adapted layers into the engine
    between two of its steps. Streamed at staleness 0 it is the whole-batch LoRA run (the reference);
    one step off, the batch is one update old and the trainer's recomputed pi_old stays within the
    numerics of the engine for the tokens of the policy that trains."""
    lora = ["model.lora_rank=4", "model.lora_alpha=8", "actor.kl_loss_coef=0.1"]
    _, sync = _lora_run(setup, tmp_path / "sync", 3, *lora, whole_batches=True)
    _, streamed = _lora_run(setup, tmp_path / "s0", 3, *lora, "trainer.async_mode=streaming",
                            "rollout.max_staleness=0")  # fmt: skip
    # the engine's own log-probs differ in the last bits (measured: 1e-9 in probability, cause not
    # found); what was sampled and trained is the same to the bit
    skipped = (
        "timing_s/",
        "timing_per_token_ms/",
        "perf/",
        "async/",
        "reward/latency",
        "training/rollout_probs_diff",
    )
    for a, b in zip(sync, streamed, strict=True):
        assert {k: v for k, v in a.items() if not k.startswith(skipped)} == {
            k: v for k, v in b.items() if not k.startswith(skipped)
        }
    RLTrainer(config(setup, tmp_path / "one", *lora, "actor.use_kl_loss=true", "trainer.total_training_steps=3",
                     "trainer.async_mode=one_step")).fit()  # fmt: skip
    one_step = read_metrics(tmp_path / "one")
    assert [m["async/staleness_max"] for m in one_step] == [0, 1, 1]
    assert (
        one_step[0]["training/rollout_probs_diff_max"] < 1e-4
    )  # step 1: the engine's policy is the trainer's


def setup_run_without_lora(setup, tmp_path):
    run = tmp_path / "plain"
    RLTrainer(config(setup, run, "trainer.total_training_steps=1")).fit()
    return run


@pytest.mark.slow
def test_lora_with_offloaded_weights_is_the_one_worker_lora_run(setup, tmp_path):
    """actor.offload_params with LoRA: base and adapters under FSDP2 in one worker (on a GPU their
    shards wait in CPU memory between uses), the reference the same model with its adapters off, the
    engine given each gathered layer's merged weights (checked every step): the plain LoRA run."""
    lora = ["model.lora_rank=4", "model.lora_alpha=8", "actor.kl_loss_coef=0.1", "trainer.save_freq=2",
            "trainer.guards.weight_sync_check=true"]  # fmt: skip
    _, plain = _lora_run(setup, tmp_path / "plain", 2, *lora)
    worker, offloaded = _lora_run(setup, tmp_path / "off", 2, *lora, "actor.offload_params=true")
    assert isinstance(worker.actor.model, FSDPModule)
    for a, b in zip(plain, offloaded, strict=True):
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "training/rollout_probs_diff_max"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    assert offloaded[-1]["actor/kl_loss"] > 1e-6  # the adapters moved the policy off its base
    for part in ("policy/model.safetensors", "policy_adapter/adapter_model.safetensors"):
        want, got = (
            load_file(run / "checkpoints/global_step_2" / part)
            for run in (tmp_path / "plain", tmp_path / "off")
        )
        assert want.keys() == got.keys()
        for name in want:
            assert_close(got[name], want[name], atol=1e-6, rtol=0, msg=name)


@pytest.mark.slow
def test_lora_on_the_transformers_path_goes_through_peft(setup, tmp_path):
    run = tmp_path / "peft"
    worker, _ = _lora_run(
        setup, run, 2, "model.impl=hf", "model.lora_rank=4", "model.lora_target_modules=[q_proj,v_proj]"
    )
    trained = worker.actor.model.eval()  # PEFT's: generate runs this same module
    trainable = [n for n, p in trained.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    assert export_checkpoint(run, tmp_path / "merged").max_logit_diff <= 1e-5
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert_close(_logits(merged), _logits(trained), atol=1e-5, rtol=0)
    assert export_adapter(run, tmp_path / "adapter").max_logit_diff <= 1e-5
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(setup / "model"), tmp_path / "adapter"
    )
    assert_close(_logits(peft.eval()), _logits(trained), atol=1e-5, rtol=0)  # on the untouched base


def test_the_merged_forward_runs_the_engine_s_weights_and_trains_the_adapters():
    """model.lora_merged_forward: under bf16 autocast an adapted layer computes exactly what the
    engine's merged nn.Linear computes (the unmerged form differs by bf16 rounding), and its
    gradients in A and B are the unmerged form's in fp32 (the same function)."""
    torch.manual_seed(0)
    base = torch.nn.Linear(64, 96).requires_grad_(False)
    layer = apply_lora_to_one(base)
    engine = torch.nn.Linear(64, 96).requires_grad_(False)
    engine.weight.data, engine.bias.data = layer.merged_weight(), base.bias.data
    x = torch.randn(37, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        unmerged = layer(x)
        layer.merged_forward = True
        merged = layer(x)
        expected = engine(x)
    assert torch.equal(merged, expected)
    assert not torch.equal(unmerged, expected)  # what the option is for
    grads = {}
    for merged_forward in (False, True):
        layer.merged_forward = merged_forward
        layer.lora_A.grad = layer.lora_B.grad = None
        (layer(x) * torch.linspace(-1, 1, 96)).sum().backward()
        grads[merged_forward] = (layer.lora_A.grad.clone(), layer.lora_B.grad.clone())
    for a, b in zip(grads[False], grads[True]):
        assert_close(a, b, atol=1e-5, rtol=1e-4)


def apply_lora_to_one(linear: torch.nn.Linear):
    holder = torch.nn.Module()
    holder.model = torch.nn.Module()
    holder.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    holder.model.layers[0].proj = linear
    apply_lora(holder, 8, 16, ["proj"])
    layer = holder.model.layers[0].proj
    layer.lora_B.data = torch.randn(layer.lora_B.shape, generator=torch.Generator().manual_seed(1)) * 1e-2
    return layer


def test_a_merged_forward_without_adapters_is_refused(setup, tmp_path):
    with pytest.raises(UserError, match="lora_merged_forward=true applies to LoRA adapters"):
        config(setup, tmp_path, "model.lora_merged_forward=true")


def test_a_lora_run_with_the_merged_forward_trains_with_engine_parity(setup, tmp_path):
    worker, metrics = _lora_run(
        setup, tmp_path / "run", 2, "model.lora_rank=4", "model.lora_merged_forward=true"
    )
    assert all(m.merged_forward for m in lora_modules(worker.actor.model).values())
    assert any(m.lora_B.abs().max() > 0 for m in lora_modules(worker.actor.model).values())
