"""Speculative decoding from the engine's own history (engine/drafter.py, decode_runs.DecodeRuns._speculate): drafts
from the prompt, the samples in flight and earlier responses; a verified step keeps what the plain
engine would have drawn, so outputs are the plain engine's token for token, greedy or sampled, and the
sampled distribution is the model's."""

import math
import time
from dataclasses import replace

import numpy as np
import pytest
import torch
from rl_run import config as rl_config
from rl_run import read_metrics

from hybridflow.controller.trainer import RLTrainer
from hybridflow.engine import Engine, EngineConfig
from hybridflow.engine.drafter import Drafter, SpeculativeConfig
from hybridflow.engine.sequence import Sequence
from hybridflow.engine.speculation import Speculation
from hybridflow.engine.speculation_gate import SpeculationGate
from hybridflow.engine.verify import kept_tokens, plan_rows
from hybridflow.models import tiny_model
from hybridflow.models.native import from_hf_model
from hybridflow.rollout.sampling import SamplingParams

PROMPTS = [[5, 9, 200, 17, 3, 8] * 3, list(range(30, 66)), [250, 1, 2]]


def _sequence(seq_id, prompt, generated=()):
    return Sequence(seq_id, 0, [*prompt, *generated], len(prompt), seed=0)


def test_drafts_come_from_the_prompt_the_siblings_and_earlier_responses():
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=2))
    prompt = [1, 2, 3, 4, 5, 6, 2, 3]
    # the prompt: "2 3" was followed by "4 5 6"
    assert drafter.draft(_sequence(0, prompt), 3) == [4, 5, 6]
    # at most `most`, and never more than num_speculative_tokens
    assert drafter.draft(_sequence(1, prompt), 2) == [4, 5]
    assert drafter.draft(_sequence(2, prompt, [9]), 5) == []  # "3 9" occurs nowhere
    # a sibling in flight: what it sampled after the prompt drafts for another sample
    sibling = _sequence(3, prompt, [7, 8, 9, 10])
    drafter.draft(sibling, 3)
    other = _sequence(4, prompt, [7])
    assert drafter.draft(other, 3) == [8, 9, 10]  # the 2-gram (3, 7) spans the prompt's end
    # earlier responses: a finished sample's response drafts for the prompt's next request
    for s in (sibling, other):
        drafter.finished(s)
    again = _sequence(5, prompt, [7, 8])
    assert drafter.draft(again, 3) == [9, 10]
    # a response remembered from elsewhere, and a prompt never seen
    drafter.remember([42, 43], [44, 45, 46])
    assert drafter.draft(_sequence(6, [42, 43]), 3) == [44, 45, 46]  # kept after the prompt's tail
    assert drafter.draft(_sequence(7, [42, 43], [44]), 3) == [45, 46]
    assert drafter.draft(_sequence(8, [99, 98], [97]), 3) == []
    # a loop in the sequence itself drafts on around the loop, beyond where its text ends
    looping = _sequence(9, [60, 61], [1, 2, 3, 1, 2, 3, 1])
    assert drafter.draft(looping, 3) == [2, 3, 1]
    assert drafter.draft(_sequence(10, [62], [7, 7, 7]), 3) == [7, 7, 7]


def test_a_draft_takes_the_continuation_seen_most_often_and_the_latest_among_equals():
    """Three earlier responses to a prompt: after "5 6" came 7 twice, then 8 (the latest): the draft
    takes 7, and goes on from "6 7" (9, seen after it every time). Among equals the latest wins."""
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=2, prompt_lookup_min=2))
    prompt = [1, 2]
    for response in ([5, 6, 7, 9], [5, 6, 7, 9], [5, 6, 8, 10]):
        drafter.remember(prompt, response)
    assert drafter.draft(_sequence(0, prompt, [5, 6]), 2) == [7, 9]
    drafter.remember(prompt, [5, 6, 8, 11])  # 7 and 8 twice each now: 8 came last
    assert drafter.draft(_sequence(1, prompt, [5, 6]), 2) == [8, 11]


def test_misses_back_the_sequence_off_and_history_is_bounded():
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=2, history_tokens=12))
    seq = _sequence(0, [1, 2, 3, 1, 2], [3])

    def sample_a_cycle():  # the sequence samples "1 2 3": its suffix "2 3" drafts "1 2" again
        seq.tokens.extend([1, 2, 3])

    assert drafter.draft(seq, 2) == [1, 2]
    drafter.accepted(seq, 2, 0)  # rejected at the first token: one miss, no wait yet
    assert drafter.draft(seq, 2) == [1, 2]
    drafter.accepted(seq, 2, 0)  # two in a row: wait 1 token
    assert drafter.waits_for(seq) == 1 and drafter.draft(seq, 2) == []
    sample_a_cycle()
    assert drafter.waits_for(seq) == 0 and drafter.draft(seq, 2) == [1, 2]
    drafter.accepted(seq, 2, 0)  # three: wait 2, then 4, 8, ... 64 at most
    assert drafter.waits_for(seq) == 2
    for wait in (4, 8, 16, 32, 64, 64):
        sample_a_cycle()
        sample_a_cycle()
        drafter.draft(seq, 2)
        drafter.accepted(seq, 2, 0)
        assert drafter.waits_for(seq) == wait
        seq.tokens.extend([9] * (wait - 3))
        sample_a_cycle()
    assert drafter.draft(seq, 2) == [1, 2]
    drafter.accepted(seq, 2, 1)  # accepted: drafting at every token again
    assert drafter.waits_for(seq) == 0 and drafter.draft(seq, 2) == [1, 2]
    # nothing to draft counts as a miss too, its wait capped lower
    lost = _sequence(1, [7, 8, 9], [10])
    assert drafter.draft(lost, 2) == [] and drafter.waits_for(lost) == 0
    fresh = iter(range(100, 200))  # tokens never seen before: nothing to draft
    for wait in (1, 2, 4, 8, 8):
        assert drafter.draft(lost, 2) == [] and drafter.waits_for(lost) == wait
        lost.tokens += [next(fresh) for _ in range(wait)]
    # history past its budget: the least recently seen prompt's goes first
    for prompt in ([10, 11], [20, 21], [30, 31]):
        drafter.remember(prompt, [5, 6, 7, 8])  # 2 + 4 tokens each (the prompt's tail kept with it)
    assert drafter.draft(_sequence(2, [10, 11], [5]), 2) == []
    assert drafter.draft(_sequence(3, [30, 31], [5]), 2) == [6, 7]


@pytest.fixture(scope="module")
def hf_model():
    return tiny_model("qwen2", seed=3)


@pytest.fixture(scope="module")
def model(hf_model):
    return from_hf_model(hf_model)


def _engine(model, k, eos=(1,), batch=256, context=256, adaptive=False):
    """(adaptive=False: the mechanism's tests speculate whenever a draft exists, whatever it costs.)"""
    config = EngineConfig(
        max_context_tokens=context,
        max_batch_sequences=batch,
        speculative=SpeculativeConfig(num_speculative_tokens=k, max_batch_sequences=batch, adaptive=adaptive),
    )
    return Engine(model, eos_token_ids=list(eos), config=config)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=40, n=3),
        SamplingParams(temperature=0.8, max_tokens=40, n=4, seed=11),
        SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_tokens=40, n=4, seed=5),
    ],
    ids=["greedy", "temperature", "top-k-top-p"],
)
def test_speculative_outputs_are_the_plain_engines_token_for_token(model, params):
    """Epochs of the same prompts, each drafting from the earlier ones' responses: greedy twice;
    sampled with a seed, another seed (drafts mostly wrong: random text) and the first again (drafts
    right). Every token, finish reason and log-prob is the plain engine's (log-probs to float32
    rounding: a verified position's logits come from a forward over several tokens, the plain
    engine's from a decode step)."""
    epochs = [params, params] if params.greedy else [params, replace(params, seed=99), params]
    plain, spec = _engine(model, 0), _engine(model, 4)
    for p in epochs:
        want, got = plain.generate(PROMPTS, p), spec.generate(PROMPTS, p)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
        worst = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g.logprobs, w.logprobs))
        assert worst < 1e-5
    stats = spec.stats  # the last epoch's: drafts used, forwards saved
    assert stats["speculative_tokens"] > 1.5 * stats["speculative_steps"] > 0
    if not params.greedy:
        assert (
            spec.speculation.counts["drafted"] > spec.speculation.counts["accepted"]
        )  # some drafts were wrong


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of counts against probs, the categories of fewer than 5 expected pooled."""
    expected = probs * counts.sum()
    small = expected < 5
    observed, expected = counts[~small], expected[~small]
    if small.any():
        observed = torch.cat([observed, counts[small].sum()[None]])
        expected = torch.cat([expected, (probs[small].sum() * counts.sum())[None]])
    statistic = ((observed - expected) ** 2 / expected).sum()
    return torch.special.gammaincc(torch.tensor((observed.numel() - 1) / 2.0), statistic / 2).item()


@pytest.fixture(scope="module")
def peaked():
    """A tiny model whose next-token distributions are far from uniform (its LM head scaled up): a
    likely draft is accepted often, an unlikely one almost never. (transformers', native)"""
    hf = tiny_model("qwen2", seed=5)
    with torch.no_grad():
        hf.lm_head.weight.mul_(4)
    return hf, from_hf_model(hf)


@pytest.mark.parametrize("draft", ["right", "wrong"])
def test_the_sampled_distribution_is_the_models_with_drafts_right_or_wrong(peaked, draft):
    """4,000 samples of a prompt's first two tokens at temperature 0.9; every sample's second token is
    verified against a remembered draft for whatever its first token was: the likeliest next token
    (mostly accepted) or the least likely (mostly rejected, the token then drawn from the rest). The
    second token's histogram is the model's distribution (chi-square against the mixture over first
    tokens), and a draft is accepted as often as the model would draw it."""
    hf_model, model = peaked
    prompt, temperature, n = [7, 100, 3, 250, 12], 0.9, 4000
    with torch.no_grad():
        first = torch.softmax(
            hf_model(torch.tensor([prompt])).logits[0, -1].double() / temperature, -1
        )  # [V]
        after = torch.tensor([[*prompt, t] for t in range(first.numel())])
        second = torch.softmax(
            hf_model(after).logits[:, -1].double() / temperature, -1
        )  # [V, V]: p(. | first)
    drafts = second.argmax(-1) if draft == "right" else second.argmin(-1)  # [V]
    # all at once: when they are verified, no sample has a token after its first to draft from
    engine = _engine(model, 1, eos=(), batch=2 * n, context=32)  # (a row for each draft too)
    for t, d in enumerate(drafts.tolist()):
        engine.speculation.drafter.remember(prompt, [t, d])
    outs = engine.generate([prompt], SamplingParams(temperature=temperature, max_tokens=3, n=n, seed=3))
    pairs = torch.tensor([o.token_ids[:2] for o in outs])  # [n, 2]
    assert engine.stats["speculative_drafted"] == n  # every sample's second token was a verified draft
    counts = torch.bincount(pairs[:, 1], minlength=first.numel()).double()
    assert _chi_square_p(counts, first @ second) > 1e-3
    accepted = (pairs[:, 1] == drafts[pairs[:, 0]]).double().mean().item()
    expected = (first * second.gather(1, drafts[:, None])[:, 0]).sum().item()
    assert abs(accepted - expected) < 5 * math.sqrt(expected * (1 - expected) / n) + 1e-4
    assert engine.stats["speculative_accepted"] == round(accepted * n)
    assert (expected > 0.2) if draft == "right" else (expected < 0.01)  # (the model is peaked)


@pytest.mark.parametrize(
    "mode",
    [
        ["trainer.async_mode=off"],
        ["trainer.async_mode=streaming", "rollout.max_staleness=1"],
        ["trainer.async_mode=off", "model.lora_rank=4", "model.lora_alpha=8"],
    ],
    ids=["synchronous", "streaming", "lora"],
)
def test_a_training_run_with_speculation_samples_what_a_plain_run_samples(setup, tmp_path, mode):
    """`hybridflow train rollout.speculative.num_speculative_tokens=4` beside the same run without,
    synchronous and streaming (the engine pausing for the trainer, sequences in flight across an
    update): the same responses every step (rewards and lengths equal; losses to float32 rounding),
    and rollout/speculative_* metrics that say drafts were checked."""
    runs = {}
    spec = [
        "rollout.speculative.num_speculative_tokens=4",
        "rollout.speculative.max_batch_sequences=128",
        "rollout.speculative.adaptive=false",
    ]
    for name, extra in (("plain", []), ("speculative", spec)):
        run_dir = tmp_path / name
        config = rl_config(
            setup, run_dir, "trainer.total_training_steps=3", "trainer.save_freq=-1", *mode, *extra
        )
        RLTrainer(config).fit()
        runs[name] = read_metrics(run_dir)
    for plain, spec in zip(runs["plain"], runs["speculative"]):
        for key in ("critic/rewards/mean", "response_length/mean", "response_length/max"):
            assert spec[key] == plain[key], key
        assert abs(spec["actor/pg_loss"] - plain["actor/pg_loss"]) < 1e-4
        per_row = spec["rollout/speculative_tokens_per_row"]
        assert per_row == 0 or per_row >= 1  # (0: no speculative step this batch)
        assert "rollout/speculative_steps" not in plain
    assert sum(row["rollout/speculative_drafted"] for row in runs["speculative"]) > 0


def test_drafts_fit_the_largest_decode_graph(model):
    """A speculative step's rows (a sequence's last token and its draft each) stay within
    max_batch_sequences, the largest captured decode graph: with no row to spare the engine decodes
    plainly, with a few the first sequences' drafts take them; the tokens are the plain engine's."""
    params = SamplingParams(temperature=0.0, max_tokens=30, n=2)
    want = _engine(model, 0, batch=2).generate([PROMPTS[0]], params)
    full = _engine(model, 4, batch=2)  # two sequences in two rows: nothing to spare
    assert [o.token_ids for o in full.generate([PROMPTS[0]], params)] == [o.token_ids for o in want]
    assert full.speculation.counts["steps"] == 0
    some = _engine(model, 4, batch=5)  # three rows to spare
    assert [o.token_ids for o in some.generate([PROMPTS[0]], params)] == [o.token_ids for o in want]
    assert some.speculation.counts["steps"] > 0
    assert (
        some.speculation.counts["rows"] + some.speculation.counts["drafted"]
        <= 5 * some.speculation.counts["steps"]
    )


def test_verify_rows_fit_slots_and_graph_and_keep_drafts_up_to_the_first_difference():
    """plan_rows / kept_tokens by hand: three sequences, drafts cut by free slots and by the rows
    left under the largest graph (earlier sequences first); then draws that agree with a draft for
    two tokens, differ at the first, and agree with a whole draft (its bonus draw kept too)."""
    rows = plan_rows([10, 20, 30], [5, 7, 9], [[11, 12, 13], [21, 22], [31, 32]], slots=[3, 8, 8], max_rows=7)
    # sequence 0: 3 slots -> 2 drafted; sequence 1: 2 (rows 3 + 2 + 1 = 6); sequence 2: 1 row left -> 0
    assert rows.drafts == [[11, 12], [21, 22], []]
    assert rows.tokens == [10, 11, 12, 20, 21, 22, 30]
    assert rows.positions == [5, 6, 7, 7, 8, 9, 9]
    assert rows.ahead == [0, 1, 2, 0, 1, 2, 0] and rows.owner == [0, 0, 0, 1, 1, 1, 2]
    assert plan_rows([1, 2], [0, 0], [[5], [6]], slots=[4, 4], max_rows=2) is None  # no row to spare
    drawn = np.zeros((4, 7))
    drawn[0] = [11, 12, 99, 77, 21, 22, 40]  # seq 0: both drafts match, bonus 99; seq 1: differs at once
    drawn[1] = np.arange(7)  # (log-probs, to see which rows land where)
    run, kept = kept_tokens(drawn, rows)
    assert kept == [3, 1, 1]
    assert run[:3, 0, 0].tolist() == [11, 12, 99] and run[:3, 1, 0].tolist() == [0, 1, 2]
    assert run[0, 0, 1] == 77 and run[0, 1, 1] == 3 and run[0, 0, 2] == 40


def test_the_gate_takes_whichever_measures_faster_and_tries_the_other_now_and_then():
    """SpeculationGate by hand: each kind is tried before anything is measured (speculation first);
    then the one whose running sequences gain more tokens per second, and the other once after
    explore_every - 1 runs of it; the measures are moving averages (smoothing 0.5 here)."""
    gate = SpeculationGate(explore_every=4, smoothing=0.5)
    assert gate.speculate() is True
    gate.observe(True, seconds=0.02, tokens=30, sequences=10)  # 150 tokens/s a sequence
    assert gate.speculate() is False
    gate.observe(False, seconds=0.04, tokens=80, sequences=10)  # 200: plain is faster
    # (the run that measured plain counts: three of it in a row, then speculation once)
    assert [gate.speculate() for _ in range(8)] == [False, False, True, False, False, False, True, False]
    gate.observe(True, seconds=0.01, tokens=50, sequences=10)  # 500: the average is 325
    assert gate.rate[True] == 325.0 and gate.rate[False] == 200.0
    assert [gate.speculate() for _ in range(4)] == [True, True, True, False]
    gate.observe(True, seconds=0.0, tokens=5, sequences=1)  # nothing timed: nothing learned
    gate.observe(False, seconds=1.0, tokens=0, sequences=0)
    assert gate.rate == {True: 325.0, False: 200.0}


def test_an_adaptive_engine_measures_both_kinds_and_samples_what_the_plain_engine_samples(model):
    """With the gate (rollout.speculative.adaptive, the default) the engine times speculating and its
    plain runs as it goes (each is tried before either is measured) and picks by them; either way
    the tokens are the plain engine's. (Which it picks after that is this machine's timing.)"""
    params = SamplingParams(temperature=0.8, max_tokens=60, n=3, seed=4)
    want = _engine(model, 0).generate(PROMPTS, params)
    engine = _engine(model, 4, batch=16, adaptive=True)
    outs = [engine.generate(PROMPTS, params) for _ in range(2)]
    for out in outs:
        assert [o.token_ids for o in out] == [o.token_ids for o in want]
    assert engine.speculation.gate.rate[True] is not None and engine.speculation.gate.rate[False] is not None
    counts = engine.counters()
    assert counts["speculative_speculating_tokens"] > 0 and counts["speculative_plain_tokens"] > 0
    assert counts["speculative_speculating_tokens"] + counts["speculative_plain_tokens"] == sum(
        len(o.token_ids) for out in outs for o in out
    ) - len(PROMPTS) * params.n * len(outs)  # every token but the prefills' first ones, while <= 16 ran


def test_the_gate_leaves_graph_captures_out_of_what_it_measures(model):
    """A bucket's first run captures its CUDA graph (seconds, once): the gate and the timing counters
    leave that out, or one capture would make speculating look slow for many runs after it. Here
    every decode run first "captures" for 0.5 s (the runner's capture_seconds grows by it); the runs
    themselves take milliseconds (~300 ms in all on a loaded 2-core machine, 2026-12-07: the bound is
    the captures' time, which the counters would exceed had they taken any capture in)."""
    params = SamplingParams(temperature=0.8, max_tokens=40, n=3, seed=4)
    engine = _engine(model, 4, batch=16, adaptive=True)
    decode, runner = engine.runner.decode, engine.runner

    def decode_that_captures(*args, **kwargs):
        start = time.perf_counter()
        time.sleep(0.5)
        runner.capture_seconds += time.perf_counter() - start
        return decode(*args, **kwargs)

    runner.decode = decode_that_captures
    engine.generate(PROMPTS, params)
    counts = engine.counters()
    timed_ms = counts["speculative_speculating_ms"] + counts["speculative_plain_ms"]
    assert counts["speculative_speculating_tokens"] > 0 and counts["speculative_plain_tokens"] > 0
    assert 0 < timed_ms < runner.capture_seconds * 1000  # (with the captures: more than all of them)


def test_speculation_plans_a_verifying_step_settles_its_draws_and_counts():
    """Speculation (engine/speculation.py) apart from the engine: too many running -> a plain run
    (None); a draft from the prompt; rows planned within the free cache slots; the draws settled
    (drafted tokens kept up to the first miss, then the draw) and handed to the engine's record;
    the counters by hand."""
    spec = Speculation(
        SpeculativeConfig(
            num_speculative_tokens=3, prompt_lookup_max=2, max_batch_sequences=2, adaptive=False
        ),
        torch.device("cpu"),
    )
    assert spec.choose(3) is None and spec.choose(2) is True
    prompt = [1, 2, 3, 4, 5, 6, 2, 3]
    a, b = _sequence(0, prompt), _sequence(1, [40, 41, 42])
    for s in (a, b):
        s.cached, s.pages, s.end = len(s.tokens) - 1, [1], 64
    drafts = spec.drafts([a, b])
    assert drafts == {0: [4, 5, 6], 1: []}
    rows = spec.plan([a, b], drafts, page_size=16, max_rows=8)
    assert (
        rows.tokens == [3, 4, 5, 6, 42]
        and rows.positions == [7, 8, 9, 10, 2]
        and rows.owner == [0, 0, 0, 0, 1]
    )
    assert spec.plan([a, b], drafts, page_size=16, max_rows=2) is None  # no row for a drafted token
    drawn = np.zeros((4, 5))
    drawn[0] = [4, 5, 9, 7, 43]  # a: 4 and 5 kept, 9 drawn where 6 was drafted; b: its one draw
    recorded = []

    def record(batch, run, kept):
        recorded.append(kept)
        for s, n in zip(batch, kept):
            s.tokens += run[:n, 0, batch.index(s)].astype(int).tolist()

    spec.settle([a, b], rows, drawn, record)
    assert recorded == [[3, 1]] and a.tokens[-3:] == [4, 5, 9] and b.tokens[-1] == 43
    assert {k: spec.counts[k] for k in ("steps", "rows", "drafted", "accepted", "tokens")} == {
        "steps": 1, "rows": 2, "drafted": 3, "accepted": 2, "tokens": 4,
    }  # fmt: skip
