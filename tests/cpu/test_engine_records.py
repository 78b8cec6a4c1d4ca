"""The engine's two pure seams: a request's samples (request_samples: seeds, resumed tokens) and a
run's record (record_run: tokens kept up to a limit, a stop or the length), on hand-built inputs."""

import math

import numpy as np
import pytest
import torch

from hybridflow.engine.requests import SampleSoFar, request_samples
from hybridflow.engine.sampler import step_keys
from hybridflow.engine.sequence import Sequence, record_run
from hybridflow.rollout.sampling import NonFiniteLogits, SamplingParams


def run_of(tokens, logprobs, stops) -> np.ndarray:
    """A run [steps, 4, B] from per-sequence rows [B][steps] (unscaled log-prob = log-prob - 1)."""
    t, lp, st = (np.array(x, dtype=np.float64).T for x in (tokens, logprobs, stops))  # [steps, B]
    return np.stack([t, lp, lp - 1, st], axis=1)


def running(prompt_len: int, generated: int, end: int) -> Sequence:
    tokens = list(range(prompt_len + generated))
    return Sequence(0, 0, tokens, prompt_len, seed=1, cached=len(tokens) - 1, end=end)


def test_a_run_keeps_tokens_up_to_each_sequences_limit_stop_or_length():
    # prompt 3 + 1 token so far each; run of 4 steps
    free = running(3, 1, end=100)  # limit 4, no stop: keeps all 4, still running
    short_limit = running(3, 1, end=100)  # limit 2: keeps 2 (the steps past its pages are not its)
    stopped = running(3, 1, end=100)  # stop flag at step 1: keeps 2, 'stop'
    at_length = running(3, 1, end=7)  # 4 tokens now, end 7: the token of step 2 is its 7th, 'length'
    run = run_of(
        tokens=[[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33], [40, 41, 42, 43]],
        logprobs=[[-0.5, -1.0, -1.5, -2.0]] * 4,
        stops=[[0, 0, 0, 0], [0, 0, 1, 0], [0, 1, 0, 1], [0, 0, 0, 0]],
    )
    finished = record_run([free, short_limit, stopped, at_length], run, limits=[4, 2, 4, 4])
    assert finished == [stopped, at_length]
    assert free.tokens[4:] == [10, 11, 12, 13] and free.cached == 7 and free.finish_reason is None
    # its stop flag at step 2 lies past its limit: not its token
    assert (
        short_limit.tokens[4:] == [20, 21] and short_limit.cached == 5 and short_limit.finish_reason is None
    )
    assert stopped.tokens[4:] == [30, 31] and stopped.finish_reason == "stop"
    assert at_length.tokens[4:] == [40, 41, 42] and at_length.finish_reason == "length"
    assert stopped.logprobs == [-0.5, -1.0] and stopped.unscaled_logprobs == [-1.5, -2.0]


def test_a_non_finite_log_prob_is_an_error_only_where_a_token_is_kept():
    seq = running(2, 1, end=100)
    run = run_of(tokens=[[5, 6, 7]], logprobs=[[-0.1, -0.2, math.nan]], stops=[[0, 1, 0]])
    assert record_run([seq], run, limits=[3]) == [seq]  # the NaN lies after its stop
    seq = running(2, 1, end=100)
    run = run_of(tokens=[[5, 6, 7]], logprobs=[[-0.1, math.inf, -0.3]], stops=[[0, 0, 0]])
    with pytest.raises(NonFiniteLogits):
        record_run([seq], run, limits=[3])


def test_a_requests_samples_draw_from_their_own_streams_and_resume_where_they_were():
    params = SamplingParams(n=3, max_tokens=10, first_sequence=5)
    resume = [None, SampleSoFar([7, 8], [-0.25, -0.5]), SampleSoFar([9], [-1.0], finish_reason="stop")]
    samples = request_samples("r", [1, 2, 3], params, resume, first_seq_id=40, seed=11, max_context=64)
    expected_keys = step_keys(torch.full((3,), 11, dtype=torch.int64), torch.arange(5, 8)).tolist()
    assert [s.seed for s in samples] == expected_keys
    assert [s.seq_id for s in samples] == [40, 41, 42] and [s.sample for s in samples] == [0, 1, 2]
    assert [s.end for s in samples] == [13, 13, 13]  # prompt 3 + max_tokens 10
    assert samples[0].tokens == [1, 2, 3] and samples[0].reported == 0
    assert (
        samples[1].tokens == [1, 2, 3, 7, 8]
        and samples[1].reported == 2
        and samples[1].logprobs == [-0.25, -0.5]
    )
    assert samples[2].finish_reason == "stop" and samples[2].tokens == [1, 2, 3, 9]
    # the context bounds the end before max_tokens does
    assert request_samples("r", [1] * 60, params, None, first_seq_id=0, seed=1, max_context=64)[0].end == 64


def test_a_resume_that_cannot_go_on_is_refused():
    params = SamplingParams(n=2, max_tokens=4)
    with pytest.raises(ValueError, match="one entry per sample"):
        request_samples("r", [1], params, [None], first_seq_id=0, seed=1, max_context=64)
    done = SampleSoFar([2], [-1.0], finish_reason="length")
    with pytest.raises(ValueError, match="one to go on with"):
        request_samples("r", [1], params, [done, done], first_seq_id=0, seed=1, max_context=64)
    full = SampleSoFar([2, 3, 4, 5], [-1.0] * 4)  # prompt 1 + 4 = its end: no room left
    with pytest.raises(ValueError, match="sample 0 has no room left"):
        request_samples("r", [1], params, [full, None], first_seq_id=0, seed=1, max_context=64)


def test_the_run_after_an_unread_one_takes_each_rows_steps_left_or_none():
    from hybridflow.engine.sequence import limits_after

    going = running(3, 1, end=100)  # 4 tokens; 4 more in the unread run, 92 left after: k
    near_end = running(3, 1, end=10)  # 4 + 4 = 8 of 10: 2 left
    by_length = running(3, 1, end=6)  # took 2 (its limit): ends by length in the unread run
    done = running(3, 1, end=100)
    done.finish_reason = "stop"  # ended in a run read before
    assert limits_after([going, near_end, by_length, done], [4, 4, 2, 4], k=4) == [4, 2, 0, 0]
    # a live row that took fewer steps than its run (pages short): its device state went past it
    assert limits_after([going, running(3, 1, end=100)], [4, 2], k=4) is None
    # nothing left to run
    assert limits_after([by_length, done], [2, 4], k=4) is None
