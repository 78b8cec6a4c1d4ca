"""Throughput metrics by hand: verl's per-token timings and throughput, and the actor's MFU."""

import pytest

from hybridflow.controller.perf import perf_metrics, training_flops
from hybridflow.plan.memory import ModelShape

SHAPE = ModelShape(params=1000, vocab=10, hidden=8, intermediate=16, layers=2, heads=2, kv_heads=1,
                   head_dim=4, tied=False)  # fmt: skip


def test_flops_count_dense_work_and_causal_attention():
    # untied: the 80 input-embedding parameters are a lookup, not a matmul
    dense = 6 * (1000 - 80) * (3 + 5)
    attention = 6 * 2 * 2 * 4 * (3 * 3 + 5 * 5)
    assert training_flops(SHAPE, [3, 5]) == dense + attention


def test_per_token_timings_throughput_and_mfu():
    times = {"step": 4.0, "gen": 2.0, "ref": 0.5, "update_actor": 1.0}
    m = perf_metrics(
        times,
        prompt_lengths=[1, 2],
        response_lengths=[2, 3],
        devices=2,
        shape=SHAPE,
        actor_passes=2,
        peak=1e6,
    )
    assert m["perf/total_num_tokens"] == 8
    assert m["perf/throughput"] == 8 / 4.0 / 2  # tokens per second per device
    assert m["perf/gen_tokens_per_s"] == 5 / 2.0  # response tokens only
    assert m["timing_per_token_ms/gen"] == pytest.approx(1000 * 2.0 / 5)
    assert m["timing_per_token_ms/ref"] == pytest.approx(1000 * 0.5 / 8)
    assert m["timing_per_token_ms/update_actor"] == pytest.approx(1000 * 1.0 / 8)
    assert m["perf/mfu/actor"] == pytest.approx(2 * training_flops(SHAPE, [3, 5]) / 1.0 / (1e6 * 2))
    assert m["perf/cpu_memory_used_gb"] > 0
    # no known peak (a CPU): no MFU rather than a made-up one
    assert "perf/mfu/actor" not in perf_metrics(times, prompt_lengths=[1], response_lengths=[2], devices=1)
