"""rollout.exact_logprobs: the engine's sampled log-probs equal the trainer's to the bit (the
batch-invariant kernels in hybridflow/kernels, run on CPU tensors by Triton's interpreter)."""

from interpreter import in_triton_interpreter


def test_engine_and_trainer_log_probs_are_the_same_bits_in_the_interpreter():
    """Tiny qwen2 (float32, the engine's own copy) and llama (bfloat16 autocast, the trainer's own
    module): every sampled token's log-prob from the engine equals the trainer's packed forward over
    the same tokens, bit for bit; the ordinary kernels give a small nonzero gap on the same tokens
    (so the equality is not vacuous); a prompt alone gets its batch's bits; a prefix-cache hit too;
    gradients through the exact kernels equal the ordinary model's to float32 rounding."""
    stdout = in_triton_interpreter("exact_logprobs_check.py", timeout=600)
    assert stdout.count("engine and trainer log-probs: ok") == 2
    assert stdout.count("max gap 0.0e+00") == 2
    assert stdout.count("the ordinary kernels differ: ok") == 2
    assert stdout.count("alone as in the batch: ok") == 2
    assert stdout.count("from the prefix cache: ok (hit True)") == 2
    assert "gradients through the exact kernels: ok" in stdout
