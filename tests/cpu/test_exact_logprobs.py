"""rollout.exact_logprobs: the engine's sampled log-probs equal the trainer's to the bit (the
batch-invariant kernels in hybridflow/kernels, run on CPU tensors by Triton's interpreter)."""

import os
import subprocess
import sys

import pytest
from interpreter import in_triton_interpreter
from rl_run import arguments, measured, read_metrics

from hybridflow.config import load_config
from hybridflow.controller.setup import check_config
from hybridflow.errors import UserError
from hybridflow.models import tiny_model
from hybridflow.models.lora import apply_lora
from hybridflow.models.native import from_hf_model


def test_engine_and_trainer_log_probs_are_the_same_bits_in_the_interpreter():
    """Tiny qwen2 (float32, the engine's own copy) and llama (bfloat16 autocast, the trainer's own
    module): every sampled token's log-prob from the engine equals the trainer's packed forward over
    the same tokens, bit for bit; the ordinary kernels give a small nonzero gap on the same tokens
    (so the equality is not vacuous); with the engine's own copy, a prompt alone gets its batch's bits,
    and a prefix-cache hit too, and speculative decoding's verified positions too; with a vocabulary
    wider than the device sampler's slices (whose own log-softmax then rounds otherwise: the decode
    step's record must carry the trainer's kernel's values, which fails without it);
    gradients through the exact kernels equal the ordinary model's to float32 rounding, each prompt
    packed once for its responses too (whose attention gives the separate sequences' bits, and a
    backward that repeats); the packed attention's own backward in bfloat16 is as close to float64 as
    PyTorch's bfloat16 attention; the matmul's looped and split-chunk forms give a row its bits alone."""
    # ~6 minutes alone on 2 cores; over 15 when another suite shared them (2026-12-07): a wide deadline
    stdout = in_triton_interpreter("exact_logprobs_check.py", timeout=1800)
    assert stdout.count("engine and trainer log-probs: ok") == 3
    assert stdout.count("max gap 0.0e+00") == 3
    assert stdout.count("the ordinary kernels differ: ok") == 2
    assert stdout.count("alone as in the batch: ok") == 1
    assert stdout.count("from the prefix cache: ok (hit True)") == 1
    assert stdout.count("speculative, the plain engine's bits: ok") == 1
    assert "gradients through the exact kernels, separate: ok" in stdout
    assert "gradients through the exact kernels, shared prompts: ok" in stdout
    assert "shared-prefix exact attention: ok" in stdout
    assert "the exact trainer packs a prompt once for its responses: ok" in stdout
    assert "packed attention backward, bfloat16: ok" in stdout
    assert "residual add + norm: ok" in stdout and "residual add + norm, gradients: ok" in stdout
    assert "norm backward, bfloat16: ok" in stdout
    assert "SwiGLU torch.float32: ok" in stdout and "SwiGLU torch.bfloat16: ok" in stdout
    assert "rotary of q and k in one launch: ok" in stdout
    assert "K/V store, torch.float32: ok" in stdout and "K/V store, torch.bfloat16: ok" in stdout
    assert "matmul forms, torch.float32: ok" in stdout and "matmul forms, torch.bfloat16: ok" in stdout
    assert stdout.count("matmul with the residual add in its epilogue") == 2
    assert "epilogue, torch.float32: ok" in stdout and "epilogue, torch.bfloat16: ok" in stdout


def test_an_rl_run_with_exact_log_probs_skips_the_recompute_sees_no_gap_and_repeats(setup, tmp_path):
    """`hybridflow train rollout.exact_logprobs=true` (its kernels in the interpreter): every step the
    update's first forward finds the engine's probabilities equal to its own (the max gap is 0, which
    the run's guard requires), and no old-log-prob pass runs: the engine's are pi_old, with two
    mini-batches a step (a recompute would otherwise be needed) and a KL loss against the reference.
    A second process started beside it with the same config gives the same metrics and weights to the
    bit (the attention's backward is the kernels' own, summed in a fixed order)."""

    def start(run_dir):
        command = [sys.executable, "-m", "hybridflow.cli", "train",
                   *arguments(setup, run_dir, "rollout.exact_logprobs=true", "trainer.total_training_steps=2",
                              "data.prompts_per_step=2", "rollout.samples_per_prompt=2",
                              "data.max_response_tokens=5", "actor.sequences_per_update=2", "actor.use_kl_loss=true",
                              "trainer.val_before_train=false", "trainer.save_freq=2"),
                   "--quiet"]  # fmt: skip
        env = os.environ | {"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    runs = {name: start(tmp_path / name) for name in ("a", "b")}
    for process in runs.values():
        _, err = process.communicate(timeout=600)
        assert process.returncode == 0, err[-3000:]
    rows = read_metrics(tmp_path / "a")
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["training/rollout_probs_diff_max"] == 0.0
        assert row["training/first_minibatch_ppo_kl"] == 0.0  # the update's ratio starts at exactly 1
        assert "timing_s/old_log_prob" not in row  # pi_old is the engine's

    def weights(name):
        return (
            tmp_path / name / "checkpoints" / "global_step_2" / "policy" / "model.safetensors"
        ).read_bytes()

    assert measured(rows) == measured(read_metrics(tmp_path / "b"))
    assert rows[1]["actor/grad_norm"] > 0 and weights("a") == weights("b")


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["rollout.top_p=0.9"], "the trainer's log-probs are of the whole distribution"),
        (["rollout.top_k=20"], "the trainer's log-probs are of the whole distribution"),
        (["rollout.temperature=0"], "greedy rollouts have no sampling distribution"),
    ],
)
def test_settings_that_cannot_be_exact_are_refused_in_one_line(overrides, words):
    with pytest.raises(UserError, match=words) as e:
        load_config(None, ["rollout.exact_logprobs=true", *overrides])
    assert "\n" not in str(e.value)


def test_a_cpu_run_is_refused_in_one_line(monkeypatch):
    """The kernels are Triton's: outside its interpreter a CPU run stops before anything loads."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    config = load_config(None, ["rollout.exact_logprobs=true", "resources.device=cpu"])
    with pytest.raises(UserError, match="on CUDA only, and this run is on cpu"):
        check_config(config, 1)


def test_models_the_kernels_do_not_cover_are_named():
    moe = from_hf_model(tiny_model("qwen3_moe", seed=0))
    with pytest.raises(ValueError, match="mixture-of-experts layers are not covered yet"):
        moe.use_exact_kernels()
    dense = from_hf_model(tiny_model("qwen2", seed=0))
    apply_lora(dense, rank=2, alpha=4, targets=["q_proj"])
    with pytest.raises(ValueError, match=r"LoRA adapters \(.*q_proj\) are not covered yet"):
        dense.use_exact_kernels()


def test_exact_log_probs_run_every_process_on_deterministic_algorithms():
    """Exact runs are to repeat: with the kernels' own sums fixed, what torch's deterministic algorithms
    fix (its atomics-free index and embedding kernels, a fixed cuBLAS workspace) comes with them, in
    every process that devices.seed_process starts."""
    assert load_config(None, ["rollout.exact_logprobs=true"]).deterministic_processes
    assert load_config(None, ["trainer.deterministic=true"]).deterministic_processes
    assert not load_config(None, []).deterministic_processes


FILLS = """
import collections, sys, torch
from torch.profiler import profile, ProfilerActivity
from hybridflow.devices import seed_process
from hybridflow.models import tiny_model
from hybridflow.models.native import from_hf_model
from hybridflow.roles.forward import packed_response_logprobs
seed_process(0, deterministic=sys.argv[1] == "on")
model = from_hf_model(tiny_model("qwen2", seed=7))
with profile(activities=[ProfilerActivity.CPU]) as prof:
    logp, _ = packed_response_logprobs(model, [[5, 9, 200, 17] * 3, list(range(30, 66))], [[7, 8, 9], [3, 4]],
                                       device=torch.device("cpu"), compute_dtype="float32")
    logp.sum().backward()
print(sum(e.name == "aten::fill_" for e in prof.events()), torch.are_deterministic_algorithms_enabled())
"""


def test_deterministic_processes_do_not_fill_every_new_tensor_first():
    """torch's deterministic algorithms fill every new tensor with NaN by default, a launch per
    allocation (the exact path's many small kernels paid most of it on the H100). The run's processes
    turn that off: a forward and backward issues as many fills with the settings as without them,
    and the deterministic algorithms are on."""

    def fills(setting):
        done = subprocess.run(
            [sys.executable, "-c", FILLS, setting], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-2000:]
        count, enabled = done.stdout.split()
        return int(count), enabled == "True"

    (off, off_enabled), (on, on_enabled) = fills("off"), fills("on")
    assert on_enabled and not off_enabled
    assert on == off
