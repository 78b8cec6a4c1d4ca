"""`hybridflow plan`'s choice of a layout: the configured one kept when it fits, the micro-batch
shrunk first, tensor parallelism (the engine split with the actor where it can be) where the logits,
MLP channels or the engine's copy are what overflows, offload last, and a model that fits no rung
named as one that cannot fit."""

import pytest
from transformers import AutoConfig

from hybridflow.config import load_config
from hybridflow.models import tiny_model
from hybridflow.plan.layout import LayoutChoice, choose_layout, tensor_parallel_sizes
from hybridflow.plan.memory import GIB, PLAN_SLACK, ModelShape, engine_bytes, estimate

QWEN_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, tie_word_embeddings=True, vocab_size=151936)  # fmt: skip
QWEN_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, tie_word_embeddings=False, vocab_size=152064)  # fmt: skip
QWEN_72B = dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, tie_word_embeddings=False, vocab_size=152064)  # fmt: skip
# a 0.5B body under a million-entry vocabulary: the log-prob chunks' logits dominate the update
BIG_VOCAB = {**QWEN_05B, "vocab_size": 1_000_000, "num_attention_heads": 16, "num_key_value_heads": 4}
H200 = 139 * GIB
FP32 = ["model.dtype=float32"]  # the GPU's master weights


def _shape(**dims) -> ModelShape:
    return ModelShape.from_hf_config(AutoConfig.for_model("qwen2", max_position_embeddings=32768, **dims))


def _fits(config, shape, gpu, workers) -> bool:
    plan = estimate(config, shape, gpu_bytes=gpu, workers=workers)
    return max(plan.phases.values()) <= gpu * (1 - PLAN_SLACK)


def test_a_layout_that_fits_is_kept():
    choice = choose_layout(load_config("gsm8k_grpo", FP32), _shape(**QWEN_7B), gpu_bytes=H200, workers=8)
    assert choice.settings == {} and choice.tried == []
    assert choice.report().startswith("choice: as configured (largest phase update_actor")


def test_the_micro_batch_shrinks_first_to_the_largest_that_fits():
    shape, gpu = _shape(**QWEN_05B), 16 * GIB
    config = load_config(None, [*FP32, "actor.max_tokens_per_microbatch=65536"])
    choice = choose_layout(config, shape, gpu_bytes=gpu, workers=8)
    (micro,) = choice.settings.values()
    assert list(choice.settings) == ["actor.max_tokens_per_microbatch"] and micro % 1024 == 0
    assert _fits(load_config(None, [*FP32, f"actor.max_tokens_per_microbatch={micro}"]), shape, gpu, 8)
    assert not _fits(
        load_config(None, [*FP32, f"actor.max_tokens_per_microbatch={micro + 1024}"]), shape, gpu, 8
    )


def test_tensor_parallelism_is_chosen_where_the_logits_overflow():
    """FSDP2 already shards weights, gradients and Adam over all 8 workers; what tensor parallelism
    splits further is the logits and the LM head's backward (vocabulary / tp) and the MLP channels:
    splitting the engine alone (its copy of a million-row vocabulary) is not enough on 12 GiB, nor is
    a split in two (the head's backward alone holds 8 x 10^6 x 896 bytes / 2 = 3.3 GiB)."""
    shape, gpu = _shape(**BIG_VOCAB), 12 * GIB
    choice = choose_layout(load_config(None, FP32), shape, gpu_bytes=gpu, workers=8)
    assert choice.settings == {"model.enable_gradient_checkpointing": True, "actor.tensor_parallel_size": 4,
                               "rollout.tensor_parallel_size": 4}  # fmt: skip
    assert "tried first: tensor parallel 2 (the engine too): update_actor 14.3 GiB" in choice.report()
    assert [t.split(":")[0] for t in choice.tried] == [
        "as configured", "gradient checkpointing", "the engine split over 2", "the engine split over 4",
        "tensor parallel 2 (the engine too)"]  # fmt: skip
    checkpointed = load_config(None, [*FP32, "model.enable_gradient_checkpointing=true"])
    assert not _fits(checkpointed, shape, gpu, 8)
    assert not _fits(load_config(None, [*FP32, "model.enable_gradient_checkpointing=true",
                                        "actor.tensor_parallel_size=2", "rollout.tensor_parallel_size=2"]), shape, gpu,
                     8)  # fmt: skip
    assert _fits(load_config(None, [*FP32, "model.enable_gradient_checkpointing=true",
                                    "actor.tensor_parallel_size=4", "rollout.tensor_parallel_size=4"]), shape, gpu,
                 8)  # fmt: skip
    assert not _fits(load_config(None, [*FP32, "model.enable_gradient_checkpointing=true",
                                        "rollout.tensor_parallel_size=4"]), shape, gpu, 8)  # fmt: skip


def test_tensor_parallel_sizes_follow_heads_workers_and_the_model_kind():
    config = load_config(None, [])
    assert tensor_parallel_sizes(config, _shape(**QWEN_05B), 8) == [2]  # 14 heads, 2 KV heads
    assert tensor_parallel_sizes(config, _shape(**QWEN_7B), 8) == [2, 4]  # 28 heads, 4 KV heads
    assert tensor_parallel_sizes(config, _shape(**QWEN_7B), 2) == [2]  # the workers bound it
    moe = _shape(**QWEN_7B)
    moe.active_params, moe.experts = moe.params / 4, 6  # experts split whole: 6 over 2, not over 4
    assert tensor_parallel_sizes(config, moe, 8) == [2]
    moe.experts = 128
    assert tensor_parallel_sizes(config, moe, 8) == [2, 4]
    split = load_config(None, ["actor.expert_parallel_size=2"])  # experts over data-parallel ranks
    assert tensor_parallel_sizes(split, moe, 8) == []
    assert tensor_parallel_sizes(load_config(None, ["model.impl=hf"]), _shape(**QWEN_7B), 8) == []


QWEN_32B = {**QWEN_7B, "num_hidden_layers": 64, "hidden_size": 5120, "intermediate_size": 27648,
            "num_attention_heads": 40, "num_key_value_heads": 8}  # fmt: skip
QWEN_15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                num_key_value_heads=2, tie_word_embeddings=True, vocab_size=151936)  # fmt: skip


def test_the_engine_splits_alone_where_generation_is_what_overflows():
    """Qwen2.5-1.5B in fp32 on two 24 GiB GPUs: with checkpointing, generation beside the engine's whole
    copy is over; the engine split over both (rollout.tensor_parallel_size: its copy and KV pages
    halved) fits, training as it was."""
    shape, gpu = _shape(**QWEN_15B), 24 * GIB
    choice = choose_layout(load_config("gsm8k_grpo", FP32), shape, gpu_bytes=gpu, workers=2)
    assert choice.settings == {"model.enable_gradient_checkpointing": True, "rollout.tensor_parallel_size": 2}
    assert choice.tried[-1].startswith("gradient checkpointing: gen")
    whole = estimate(load_config("gsm8k_grpo", FP32), shape, gpu_bytes=gpu, workers=2)
    assert choice.plan.resident["engine weights"] == whole.resident["engine weights"] / 2


def test_offload_comes_last_and_without_tensor_parallelism():
    """Where the engine cannot be split (transformers' generate here), tensor parallelism alone is not
    enough; the reference and Adam in CPU memory are, and TP is left off with them."""
    shape, gpu = _shape(**QWEN_15B), 24 * GIB
    choice = choose_layout(load_config("gsm8k_grpo", [*FP32, "rollout.backend=hf"]), shape, gpu_bytes=gpu,
                           workers=2)  # fmt: skip
    assert choice.settings == {"model.enable_gradient_checkpointing": True, "ref.offload_params": True,
                               "actor.offload_optimizer": True}  # fmt: skip
    assert [t.split(":")[0] for t in choice.tried] == [
        "as configured", "gradient checkpointing", "tensor parallel 2", "the reference in CPU memory"]  # fmt: skip
    assert not any("engine split" in t for t in choice.tried)


def test_a_32b_model_cannot_load_on_eight_h200s_from_a_gguf():
    """Every worker holds the whole policy, reference and engine copy before FSDP2 shards them: 185.5
    GiB in bf16, over the GPU whatever comes after (TP 4 with the engine split would train it)."""
    shape = _shape(**QWEN_32B)
    bf16 = load_config("gsm8k_grpo", ["model.dtype=bfloat16"])
    choice = choose_layout(bf16, shape, gpu_bytes=H200, workers=8)
    assert choice.plan is None
    assert "loading holds whole copies of the models on each GPU before FSDP2 shards them (185.5 GiB" in (
        choice.report()
    )
    split = load_config("gsm8k_grpo", ["model.dtype=bfloat16", "actor.tensor_parallel_size=4",
                                       "rollout.tensor_parallel_size=4", "model.enable_gradient_checkpointing=true"])  # fmt: skip
    plan = estimate(split, shape, gpu_bytes=H200, workers=8)
    assert max(v for k, v in plan.phases.items() if k != "load") < H200 * (1 - PLAN_SLACK)


def test_a_32b_model_loads_on_eight_h200s_from_safetensors_read_shard_by_shard(tmp_path):
    """From a transformers directory in safetensors each rank reads only its shards of the policy, the
    reference and the critic (parallel/sharded_load.py): the load holds the engine's whole copy and
    shards — GRPO 78.7 GiB, PPO 86.2, against 185.5 loaded whole — and both fit with checkpointing and
    the engine split; PPO, its critic beside, also with a smaller micro-batch (room for the LM head's
    backward: 6 x 152,064 x 5,120 bytes in bf16)."""
    tiny_model("qwen2", seed=0).save_pretrained(tmp_path / "m")  # the planner reads the format, not the shape
    shape = _shape(**QWEN_32B)
    base = ["model.dtype=bfloat16", f"model.path={tmp_path / 'm'}"]
    for extra, load, split, micro in (([], 78.7, 2, {}), (["algorithm.adv_estimator=gae"], 86.2, 4, 7168)):
        config = load_config("gsm8k_grpo", [*base, *extra])
        assert estimate(config, shape, gpu_bytes=H200, workers=8).phases["load"] / GIB == pytest.approx(
            load, abs=0.05
        )
        choice = choose_layout(config, shape, gpu_bytes=H200, workers=8)
        assert choice.settings == {
            "model.enable_gradient_checkpointing": True,
            "rollout.tensor_parallel_size": split,
            **({"actor.max_tokens_per_microbatch": micro} if micro else {}),
        }


def test_a_72b_model_in_float32_fits_no_rung_of_eight_gpus():
    """fp32 master weights, gradients and Adam of 72.7B parameters over 8 (145 GiB each) do not fit
    at any tensor-parallel size; with offload the engine stays whole (137.7 GiB), which is the line."""
    shape = _shape(**QWEN_72B)
    choice = choose_layout(load_config("gsm8k_grpo", FP32), shape, gpu_bytes=H200, workers=8)
    assert isinstance(choice, LayoutChoice) and choice.plan is None
    # bf16 matmuls, an fp32 embedding and a bf16 head: 2 x (72.7e9 - 2 x 1.25e9) + 6 x 1.25e9 bytes
    e = 152064 * 8192
    assert engine_bytes(shape) == 2 * (shape.params - 2 * e) + 6 * e
    assert "tensor parallel 8 (the engine too): " in choice.report()
    assert (
        f"engine's copy of the model takes {engine_bytes(shape) / GIB:.1f} GiB of one GPU (whole"
        in choice.report()
    )
    assert choice.report().startswith("choice: nothing fits these GPUs")


def test_a_run_that_will_not_fit_hears_the_choice_at_its_start(tmp_path, capsys):
    """The trainer's start line (plan_run, once before the workers start): a Qwen2.5-7B shape (its
    config file alone) in fp32 on one 80 GiB GPU warns, then names the layout that fits; a synchronous
    run's engine frees its pool while training, so the workers are given no pool size to keep."""
    from hybridflow.plan.layout import plan_run

    AutoConfig.for_model("qwen2", max_position_embeddings=32768, **QWEN_7B).save_pretrained(tmp_path)
    assert plan_run(load_config("gsm8k_grpo", [*FP32, f"model.path={tmp_path}"])) is None
    out = capsys.readouterr().out
    assert "warning: a phase will not fit" in out
    assert "\nchoice: " in out and "actor.offload_optimizer=true" in out


def test_a_rung_training_would_refuse_is_passed_over_not_chosen():
    """Expert parallelism does not combine with offload yet: where only offload would fit, the chooser
    says the offload rung is refused (naming why) instead of approving a layout training refuses."""
    shape = _shape(**QWEN_7B)
    ep = load_config("gsm8k_grpo", [*FP32, "actor.expert_parallel_size=2", "actor.use_kl_loss=false"])
    choice = choose_layout(ep, shape, gpu_bytes=20 * GIB, workers=2)
    assert choice.settings.get("actor.offload_params") is not True
    assert any(
        "the actor in CPU memory: refused (actor.expert_parallel_size=2 with actor.offload_params=true: expert "
        "parallelism does not combine with offload_params yet" in t
        for t in choice.tried
    )


def test_hybridflow_plan_refuses_what_training_refuses(capsys):
    """`hybridflow plan` runs the start's config checks: it never plans a run that training refuses."""
    from hybridflow.cli import main

    code = main(["plan", "gsm8k_grpo", "actor.router_replay=R2", "algorithm.rollout_correction.bypass_mode=true",
                 "--gpu-memory-gib", "80"])  # fmt: skip
    assert code == 2
    assert (
        "actor.router_replay=R2 with algorithm.rollout_correction.bypass_mode=true: R2 replays the routing of the "
        "old-log-prob pass" in capsys.readouterr().err
    )
