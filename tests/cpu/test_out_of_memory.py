"""A GPU out of memory mid-run is one line naming the step, the phase, what the plan expected of it and
what to change; the watchdog remembers the phase the error left."""

import pytest
import torch
from transformers import AutoConfig

from hybridflow.config import load_config
from hybridflow.controller.watchdog import Watchdog
from hybridflow.controller.worker_group import WorkerError
from hybridflow.errors import UserError
from hybridflow.plan.memory import GIB, plan_for
from hybridflow.plan.out_of_memory import out_of_memory_line, ran_out_of_memory

# torch's message in the H100 run of 2026-12-05 (docs/benchmarks.md: the pool kept beside the update)
TORCH_SAID = (
    "CUDA out of memory. Tried to allocate 892.00 MiB. GPU 0 has a total capacity of 79.18 GiB of which "
    "800.19 MiB is free. Including non-PyTorch memory, this process has 78.39 GiB memory in use."
)
OOM = torch.OutOfMemoryError(TORCH_SAID)
STREAMING = ["data.prompts_per_step=32", "rollout.samples_per_prompt=8", "data.max_response_tokens=512",
             "trainer.async_mode=streaming", "rollout.max_staleness=3", "rollout.max_batch_sequences=1024",
             "rollout.keep_kv_on_weight_update=true"]  # fmt: skip


@pytest.fixture
def untied_1_5b(tmp_path):
    """Qwen2.5-Coder-1.5B-Instruct's shape as its GGUF converts (an untied LM head): a config alone."""
    AutoConfig.for_model(
        "qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=32768,
    ).save_pretrained(tmp_path)  # fmt: skip
    return str(tmp_path)


def test_the_watchdog_remembers_the_innermost_phase_an_error_left(tmp_path):
    with Watchdog(0, tmp_path) as dog:
        dog.step = 2
        error = RuntimeError("out of memory")
        with pytest.raises(RuntimeError), dog.phase("step"), dog.phase("update_actor"):
            raise error
        assert dog.failed == ("step 2: phase update_actor (in step)", "update_actor", id(error))
        with pytest.raises(RuntimeError), dog.phase("validation"):
            raise RuntimeError("a later error")
    assert dog.failed[:2] == ("step 2: phase validation", "validation")


def test_an_update_out_of_memory_beside_a_kept_pool_names_the_pool_and_the_micro_batch(untied_1_5b):
    config = load_config("gsm8k_grpo", [f"model.path={untied_1_5b}", *STREAMING])
    plan = plan_for(config)
    line = out_of_memory_line(config, "step 2: phase update_actor (in step)", "update_actor", OOM)
    assert "\n" not in line
    assert line.startswith(
        "step 2: phase update_actor (in step): the GPU ran out of memory (892.00 MiB asked with 800.19 MiB "
        f"free of 79.18 GiB); the memory plan put update_actor at {plan.phases['update_actor'] / GIB:.1f} GiB "
        f"of {plan.gpu_bytes / GIB:.1f} with the KV pool ({plan.kv_tokens:,} tokens) kept beside it: set "
        f"rollout.kv_cache_tokens below {plan.kv_tokens:,} or actor.max_tokens_per_microbatch below 8192 or "
        "model.enable_gradient_checkpointing=true"
    ), line
    assert line.endswith("(`hybridflow plan` shows each phase; --debug shows the traceback)")


def test_generation_out_of_memory_names_the_engines_settings(untied_1_5b):
    config = load_config("gsm8k_grpo", [f"model.path={untied_1_5b}", "rollout.gpu_memory_utilization=0.9"])
    line = out_of_memory_line(config, "step 0: phase validation", "validation", OOM)
    assert ": set rollout.gpu_memory_utilization below 0.9 or rollout.max_batch_sequences below 256 (" in line
    assert "KV pool" not in line and "the memory plan put gen at" in line


def test_a_model_without_a_plan_still_gets_where_and_what_to_lower(tmp_path):
    config = load_config("gsm8k_grpo", [f"model.path={tmp_path / 'missing'}"])
    line = out_of_memory_line(config, "step 5: phase ref (in step)", "ref", RuntimeError(TORCH_SAID))
    assert "no memory plan for this model" in line
    assert (
        "set ref.max_tokens_per_microbatch below 16384 or actor.max_tokens_per_microbatch below 8192" in line
    )


def test_an_out_of_memory_here_or_in_a_ray_worker_becomes_the_line_and_other_errors_stay(
    untied_1_5b, tmp_path
):
    config = load_config("gsm8k_grpo", [f"model.path={untied_1_5b}"])
    remote = WorkerError(
        f"worker rank 1 raised:\nTraceback (most recent call last):\n  ...\ntorch.OutOfMemoryError: {TORCH_SAID}"
    )
    with Watchdog(0, tmp_path) as dog:
        dog.step = 3
        with pytest.raises(torch.OutOfMemoryError), dog.phase("step"), dog.phase("ref"):
            raise OOM
        here = ran_out_of_memory(config, dog, 3, OOM)
        # an error that left no phase (an earlier error's phase is not its own) is placed by its step alone
        elsewhere = ran_out_of_memory(config, dog, 4, torch.OutOfMemoryError(TORCH_SAID))
        with pytest.raises(WorkerError), dog.phase("step"), dog.phase("update_actor"):
            raise remote
        there = ran_out_of_memory(config, dog, 3, remote)
    assert isinstance(here, UserError) and str(here).startswith(
        "step 3: phase ref (in step): the GPU ran out"
    )
    assert str(elsewhere).startswith("step 4: the GPU ran out of memory (892.00 MiB asked")
    assert str(there).startswith(
        "step 3: phase update_actor (in step), worker rank 1 raised: the GPU ran out of memory (892.00 MiB asked"
    )
    assert ran_out_of_memory(config, dog, 3, WorkerError("worker rank 1 raised:\nValueError: x")) is None
    assert ran_out_of_memory(config, dog, 3, RuntimeError("CUDA error: an illegal memory access")) is None


def test_a_phase_the_plan_knew_would_not_fit_gets_the_plans_own_settings(untied_1_5b):
    """A run of 2026-12-05 on an H200: 512 x 2,048 tokens in one micro-batch ran the update out of memory;
    the plan had said so at the start, with the micro-batch that fits."""
    config = load_config(
        "demo_arithmetic_grpo",
        [f"model.path={untied_1_5b}", "data.max_response_tokens=2048", "data.prompts_per_step=64",
         "rollout.samples_per_prompt=8", "actor.max_tokens_per_microbatch=1048576"],
    )  # fmt: skip
    plan = plan_for(config)
    (micro,) = [
        s.split(" (")[0] for s in plan.suggestions if s.startswith("actor.max_tokens_per_microbatch=")
    ]
    line = out_of_memory_line(config, "step 1: phase update_actor (in step)", "update_actor", OOM)
    assert f"of {plan.gpu_bytes / GIB:.1f}: set {micro} or model.enable_gradient_checkpointing=true (" in line


def test_a_reward_models_forward_out_of_memory_names_its_micro_batch(untied_1_5b):
    config = load_config("gsm8k_grpo", [f"model.path={untied_1_5b}"])
    line = out_of_memory_line(config, "step 1: phase reward (in step > gen)", "reward", OOM)
    assert ": set reward.model_max_tokens_per_microbatch below 8192 (" in line
