"""The memory planner: hand-computed resident sizes, the peaks measured on one H200 reproduced, and
suggestions when a phase cannot fit."""

import pytest
from transformers import AutoConfig

from hybridflow.config import load_config
from hybridflow.errors import UserError
from hybridflow.plan.memory import (
    ACTIVATION_BYTES,
    CUDA_CONTEXT,
    GIB,
    LOGPROB_CHUNK,
    PLAN_SLACK,
    ModelShape,
    estimate,
    head_backward_bytes,
    pool_tokens_beside_training,
)

QWEN_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
QWEN_15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
H200 = 143771 * 2**20  # nvidia-smi's total for one H200

# bench/distributed_grpo.py's run on one H200 (2026-12-01, step 2 of `--gpus 1 --steps 2 --no-save`): 64
# prompts x 8 samples, responses of 256, KL loss, default micro-batch budgets; peaks
# (torch.cuda.max_memory_allocated, GiB) per phase
BENCH = ["data.prompts_per_step=64", "rollout.samples_per_prompt=8", "data.max_response_tokens=256",
         "data.max_prompt_tokens=512", "actor.use_kl_loss=true"]  # fmt: skip
MEASURED = {
    "0.5b": {"gen": 13.4, "ref/old_log_prob": 12.2, "update_actor": 24.1, "update_weights": 10.8},
    "1.5b": {"gen": 38.5, "ref/old_log_prob": 34.4, "update_actor": 60.4, "update_weights": 32.7},
}


def _shape(**dims) -> ModelShape:
    return ModelShape.from_hf_config(
        AutoConfig.for_model("qwen2", vocab_size=151936, max_position_embeddings=32768, **dims)
    )


def test_shape_counts_the_parameters_of_the_config():
    shape = _shape(**QWEN_05B)
    assert shape.params == 494_032_768  # Qwen2.5-0.5B's published count
    assert shape.kv_bytes_per_token() == 2 * 24 * 2 * 64 * 2  # K and V, 24 layers, 2 heads of 64, bf16


def test_resident_parts_by_hand():
    shape = _shape(**QWEN_05B)
    p, e = shape.params, shape.embedding
    plan = estimate(load_config(None, BENCH), shape, gpu_bytes=H200, workers=2)
    assert plan.resident["actor weights"] == 4 * p / 2  # fp32 master, sharded two ways
    assert plan.resident["actor Adam state"] == 8 * p / 2
    assert plan.resident["reference weights"] == 4 * p / 2
    # the engine's full copy: bf16 matmuls, an fp32 embedding and a bf16 copy of the tied head
    assert plan.resident["engine weights"] == 2 * (p - e) + 4 * e + 2 * e
    assert "critic weights+grads+Adam" not in plan.resident  # GRPO has no critic


@pytest.mark.parametrize("name, dims", [("0.5b", QWEN_05B), ("1.5b", QWEN_15B)])
def test_estimate_reproduces_the_peaks_measured_on_the_h200(name, dims):
    plan = estimate(load_config(None, BENCH), _shape(**dims), gpu_bytes=H200, workers=1)
    for phase, measured in MEASURED[name].items():
        estimated = (plan.phases[phase] - CUDA_CONTEXT) / GIB  # the measurement excludes the context
        assert estimated == pytest.approx(measured, rel=0.06), phase
    assert plan.fits() and not [s for s in plan.suggestions if "max_tokens_per_microbatch" in s]


def test_a_phase_that_cannot_fit_gets_suggestions():
    shape = _shape(**QWEN_15B)
    config = load_config(None, [*BENCH, "actor.max_tokens_per_microbatch=65536"])
    plan = estimate(config, shape, gpu_bytes=48 * GIB, workers=1)
    assert not plan.fits()
    assert any(s.startswith("actor.max_tokens_per_microbatch=") for s in plan.suggestions)
    assert any("gradient_checkpointing" in s for s in plan.suggestions)
    assert "update_actor" in plan.report() and "> GPU memory" in plan.report()
    checkpointed = estimate(
        load_config(None, [*BENCH, "actor.max_tokens_per_microbatch=65536", "model.enable_gradient_checkpointing=true"]),
        shape, gpu_bytes=48 * GIB, workers=1,
    )  # fmt: skip
    assert checkpointed.phases["update_actor"] < plan.phases["update_actor"] / 2


def test_plan_command_prints_the_report(tiny_dir, capsys):
    from hybridflow.cli import main

    assert (
        main(["plan", f"model.path={tiny_dir}", "trainer.n_gpus_per_node=2", "--gpu-memory-gib", "0.5"]) == 0
    )
    out = capsys.readouterr().out
    assert "2 worker(s)" in out and "peak per phase:" in out
    assert "update_actor" in out and "suggestion:" in out  # half a GiB: the KV pool is too small
    assert "\nchoice: " in out  # and the layout that fits, or why none does


def test_plan_says_what_the_workers_would_refuse_instead_of_planning_it(tiny_dir, capsys, tmp_path):
    """A parallel layout the training workers refuse at their start is refused by the plan too, in
    their words: a tensor-parallel size that does not divide the GPUs, tensor and expert parallelism
    of an MoE model together, an expert-parallel split of a dense one."""
    from hybridflow.cli import main
    from hybridflow.models import byte_tokenizer, save_hf, tiny_model

    save_hf(tiny_model("qwen3_moe", seed=0), byte_tokenizer(), tmp_path / "moe")
    for model, settings, refusal in (
        (
            tiny_dir,
            ["trainer.n_gpus_per_node=3", "actor.tensor_parallel_size=2"],
            "needs a multiple of 2 training",
        ),
        (
            tmp_path / "moe",
            ["trainer.n_gpus_per_node=4", "actor.tensor_parallel_size=2", "actor.expert_parallel_size=2"],
            "tensor parallelism already splits the experts",
        ),
        (tiny_dir, ["trainer.n_gpus_per_node=2", "actor.expert_parallel_size=2"], "this policy has none"),
    ):
        assert main(["plan", f"model.path={model}", *settings]) != 0
        err = capsys.readouterr().err
        assert refusal in err and "peak per phase" not in err, settings
    for split in ("actor.expert_parallel_size=2", "actor.tensor_parallel_size=2"):  # the experts either way
        assert main(["plan", f"model.path={tmp_path / 'moe'}", "trainer.n_gpus_per_node=2", split]) == 0, (
            split
        )


def test_offload_and_disaggregation_move_memory_off_the_training_gpu():
    shape = _shape(**QWEN_15B)
    p = shape.params
    plain = estimate(load_config(None, BENCH), shape, gpu_bytes=H200, workers=1)
    optimizer = estimate(
        load_config(None, [*BENCH, "actor.offload_optimizer=true"]), shape, gpu_bytes=H200, workers=1
    )
    assert "actor Adam state" not in optimizer.resident  # on the GPU for the update only
    assert plain.phases["gen"] - optimizer.phases["gen"] == pytest.approx(8 * p)
    offloaded = estimate(
        load_config(None, [*BENCH, "actor.offload_params=true", "ref.offload_params=true"]), shape, gpu_bytes=H200, workers=1
    )  # fmt: skip
    assert list(offloaded.resident) == ["engine weights"]
    apart = estimate(
        load_config(None, [*BENCH, "resources.rollout_workers=1"]), shape, gpu_bytes=H200, workers=1
    )
    engine = plain.resident["engine weights"]
    assert "engine weights" not in apart.resident
    # a rollout GPU: the engine and its pool, room for max_batch_sequences (256) at full context (768
    # tokens, 12 pages of 64) ...
    kv = 256 * 12 * 64 * shape.kv_bytes_per_token()
    assert apart.phases["gen"] == pytest.approx(CUDA_CONTEXT + engine + kv)
    # ... or, where that is more, half of what is left beside the engine (gpu_memory_utilization=0.5)
    wide = estimate(
        load_config(None, [*BENCH, "resources.rollout_workers=1", "rollout.max_batch_sequences=65536"]),
        shape, gpu_bytes=H200, workers=1,
    )  # fmt: skip
    assert wide.phases["gen"] == pytest.approx(CUDA_CONTEXT + engine + 0.5 * (H200 - CUDA_CONTEXT - engine))
    assert apart.phases["update_actor"] == pytest.approx(plain.phases["update_actor"] - engine)


@pytest.mark.parametrize(
    "keeps",
    [
        "rollout.free_cache_engine=false",
        "trainer.async_mode=one_step",
        "trainer.async_mode=streaming rollout.pause_for_training=false",
        "trainer.async_mode=streaming rollout.keep_kv_on_weight_update=true",  # pausing, the K/V kept
    ],
)
def test_a_kept_kv_pool_is_counted_in_every_phase(keeps):
    shape = _shape(**QWEN_05B)
    freed = estimate(load_config(None, BENCH), shape, gpu_bytes=H200, workers=1)
    kept = estimate(load_config(None, [*BENCH, *keeps.split()]), shape, gpu_bytes=H200, workers=1)
    pool = freed.kv_tokens * shape.kv_bytes_per_token()
    assert kept.kv_tokens == freed.kv_tokens and kept.phases["gen"] == freed.phases["gen"]
    for phase in ("ref/old_log_prob", "update_actor", "update_weights"):
        assert kept.phases[phase] == pytest.approx(freed.phases[phase] + pool, abs=shape.kv_bytes_per_token())


# bench/async_modes.py's long-tail run that ran out of memory on the H200 in streaming mode (2026-12-02):
# responses of up to 4,096 tokens and micro-batches of 16 full sequences
LONG = ["data.prompts_per_step=32", "rollout.samples_per_prompt=8", "data.max_prompt_tokens=512",
        "data.max_response_tokens=4096", "rollout.max_batch_sequences=512",
        "actor.max_tokens_per_microbatch=73728"]  # fmt: skip


def test_a_pool_beside_training_gets_what_training_leaves():
    shape = _shape(**QWEN_05B)
    per_token = shape.kv_bytes_per_token()
    sync = estimate(load_config(None, LONG), shape, gpu_bytes=H200, workers=1)
    streaming = load_config(None, [*LONG, "trainer.async_mode=streaming", "rollout.pause_for_training=false"])
    plan = estimate(streaming, shape, gpu_bytes=H200, workers=1)
    # an engine that pauses for training (streaming's default) frees its pool meanwhile, as sync does
    pausing = estimate(load_config(None, [*LONG, "trainer.async_mode=streaming"]), shape, gpu_bytes=H200, workers=1)  # fmt: skip
    assert pausing.phases == sync.phases and pausing.kv_tokens == sync.kv_tokens and not pausing.pool_capped
    # the synchronous run frees its pool (512 sequences x 4,608 tokens) for the update
    assert not sync.pool_capped and sync.kv_tokens == 512 * 4608 and sync.fits()
    # kept beside an update of ~113 GiB, that pool (27 GiB) would not fit: it gets what is left
    training = max(v for k, v in sync.phases.items() if k != "gen")
    assert training + sync.kv_tokens * per_token > H200
    assert plan.pool_capped and plan.fits()
    assert plan.kv_tokens == pytest.approx((H200 * (1 - PLAN_SLACK) - training) / per_token, abs=1)
    assert plan.phases["update_actor"] == pytest.approx(H200 * (1 - PLAN_SLACK), abs=per_token)
    assert "what training leaves" in plan.summary()
    assert pool_tokens_beside_training(streaming, plan) == plan.kv_tokens
    assert any("lower actor.max_tokens_per_microbatch" in s for s in plan.suggestions)
    # disaggregated, the training GPU holds no pool, generating meanwhile or not
    apart = [*LONG, "resources.rollout_workers=1"]
    apart_sync = estimate(load_config(None, apart), shape, gpu_bytes=H200, workers=1)
    apart_async = estimate(load_config(None, [*apart, "trainer.async_mode=streaming"]), shape, gpu_bytes=H200, workers=1)  # fmt: skip
    assert apart_async.phases == apart_sync.phases and not apart_async.pool_capped


# The real-model GSM8K run of bench/real_gsm8k_runs.sh on one H100 (2026-12-05): Qwen2.5-Coder-1.5B-Instruct
# from its GGUF has an untied LM head (1.78B parameters). Synchronously its update peaked at 68.1 GiB
# (torch.cuda.max_memory_allocated); streaming with the K/V kept beside the update, the pool the plan gave it
# (365,397 tokens) ran the update out of memory: the plan had missed the LM head's backward (a bf16 copy of
# the weight, its float32 gradient, a [V, H] product; a float32 copy of that product is gone since).
GSM8K = ["data.prompts_per_step=32", "rollout.samples_per_prompt=8", "data.max_response_tokens=512",
         "actor.sequences_per_update=256", "trainer.async_mode=streaming", "rollout.max_staleness=3",
         "rollout.max_batch_sequences=1024", "rollout.keep_kv_on_weight_update=true",
         "algorithm.rollout_correction.bypass_mode=true"]  # fmt: skip
H100 = 81559 * 2**20  # nvidia-smi's total for one H100 80GB HBM3
ALLOCATOR_SLACK = GIB  # the allocator's cached, unallocated blocks beside the context (0.27 GiB in that run)


def test_the_pool_kept_beside_the_update_leaves_room_for_the_update_measured_on_an_h100():
    shape = _shape(**dict(QWEN_15B, tie_word_embeddings=False))
    plan = estimate(load_config("gsm8k_grpo", GSM8K), shape, gpu_bytes=H100, workers=1)
    synchronous = estimate(load_config("gsm8k_grpo", GSM8K[:4]), shape, gpu_bytes=H100, workers=1)
    assert (synchronous.phases["update_actor"] - CUDA_CONTEXT) / GIB == pytest.approx(68.1, rel=0.03)
    pool = plan.kv_tokens * shape.kv_bytes_per_token()
    assert plan.pool_capped and plan.kv_tokens < 365_397
    assert 68.1 * GIB + pool + CUDA_CONTEXT + ALLOCATOR_SLACK <= H100


def test_a_pool_beside_training_with_no_room_for_one_sequence_stops_the_run():
    shape = _shape(**QWEN_05B)
    config = load_config(
        None, [*LONG, "trainer.async_mode=one_step", "actor.max_tokens_per_microbatch=84000"]
    )
    plan = estimate(config, shape, gpu_bytes=H200, workers=1)
    assert plan.kv_tokens == 0 and plan.fits()  # the update alone takes what the slack leaves
    with pytest.raises(
        UserError,
        match="leaves it 0 tokens, less than one sequence of 4,608: .*lower actor.max_tokens_per_microbatch",
    ):
        pool_tokens_beside_training(config, plan)


def test_moe_activations_count_the_active_experts():
    """Qwen3-30B-A3B (48 sparse layers, 8 of 128 experts of 768 channels, hidden 2048) and Mixtral
    8x7B (2 of 8 experts of 14,336, hidden 4,096): a token keeps each chosen expert's channels and a
    copy of its hidden state; a Qwen3-MoE dense layer (mlp_only_layers) its intermediate size."""
    qwen = AutoConfig.for_model(
        "qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, mlp_only_layers=[], decoder_sparse_step=1,
    )  # fmt: skip
    assert ModelShape.from_hf_config(qwen).intermediate == 8 * (768 + 2048)
    qwen.mlp_only_layers = [0, 1]  # two dense layers of 6,144
    assert ModelShape.from_hf_config(qwen).intermediate == pytest.approx(
        (46 * 8 * (768 + 2048) + 2 * 6144) / 48
    )
    mixtral = AutoConfig.for_model(
        "mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
    )  # fmt: skip
    shape = ModelShape.from_hf_config(mixtral)
    assert shape.intermediate == 2 * (14336 + 4096)
    assert shape.params == pytest.approx(46.7e9, rel=0.01)  # Mixtral 8x7B's published count
    assert shape.active_params == pytest.approx(12.9e9, rel=0.01)  # and its active count
    qwen.mlp_only_layers = []
    assert ModelShape.from_hf_config(qwen).active_params == pytest.approx(3.3e9, rel=0.02)  # "A3B"
    dense = _shape(**QWEN_05B)
    assert dense.active_params == dense.params


def test_tensor_parallelism_splits_the_channels_activations_and_the_logits():
    """Two GPUs either way: FSDP over both, or one tensor-parallel pair (FSDP over one group); the
    same resident shards, and in the update each rank keeps half the intermediate channels' saved
    activations and half the vocabulary's logits and LM-head gradient."""
    shape = _shape(**QWEN_15B)
    fsdp = estimate(load_config(None, BENCH), shape, gpu_bytes=H200, workers=2)
    tp = estimate(
        load_config(None, [*BENCH, "actor.tensor_parallel_size=2"]), shape, gpu_bytes=H200, workers=2
    )
    assert tp.resident == fsdp.resident
    tokens = load_config(None, BENCH).actor.max_tokens_per_microbatch
    saved = shape.layers * ACTIVATION_BYTES * shape.intermediate / 2 * tokens
    logits = 2 * LOGPROB_CHUNK * shape.vocab / 2 * 2
    head = head_backward_bytes(shape) / 2  # the LM head's backward over half the vocabulary
    assert tp.phases["update_actor"] == pytest.approx(fsdp.phases["update_actor"] - saved - logits - head)
