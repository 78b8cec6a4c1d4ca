"""trainer.async_mode: the stream of groups, admission under rollout.max_staleness, token versions
across in-flight weight updates, and staleness 0 as the synchronous run bit for bit."""

import json
import shutil
import time

import pytest
import torch
from rl_run import config, read_metrics, whole_batch_fit
from safetensors.torch import load_file

from hybridflow.batch import GapScope, Prompt, Rollouts
from hybridflow.controller.trainer import RLTrainer
from hybridflow.engine import Engine, EngineConfig
from hybridflow.errors import UserError
from hybridflow.models import tiny_model
from hybridflow.models.native import from_hf_model
from hybridflow.roles.forward import packed_response_logprobs
from hybridflow.rollout.sampling import SamplingParams
from hybridflow.stream.local import GroupStream
from hybridflow.stream.staleness import gap_scopes

NOT_COMPARED = ("timing_s/", "timing_per_token_ms/", "perf/", "async/", "reward/latency")


def run(setup, run_dir, steps, *overrides, whole_batches=False):
    """The run's metrics; `whole_batches`: the reference, each step generated as one batch (rl_run.py)."""
    c = config(
        setup, run_dir, f"trainer.total_training_steps={steps}", "trainer.val_before_train=false", *overrides
    )
    whole_batch_fit(c) if whole_batches else RLTrainer(c).fit()
    return read_metrics(run_dir)


def policy(run_dir, step):
    return load_file(run_dir / "checkpoints" / f"global_step_{step}" / "policy" / "model.safetensors")


def test_streaming_with_staleness_0_is_the_synchronous_run_bit_for_bit(setup, tmp_path):
    """The synchronous run (trainer.async_mode=off) and streaming at staleness 0 both take the stream
    of groups; both are the reference run that generates each step as one batch, to the bit."""
    whole = run(setup, tmp_path / "whole", 3, whole_batches=True)
    sync = run(setup, tmp_path / "sync", 3)
    streamed = run(setup, tmp_path / "s0", 3, "trainer.async_mode=streaming", "rollout.max_staleness=0")
    for a, b, c in zip(whole, sync, streamed, strict=True):
        compared = {k: v for k, v in a.items() if not k.startswith(NOT_COMPARED)}
        assert compared == {k: b[k] for k in compared} == {k: c[k] for k in compared}
        assert c["async/staleness_max"] == 0.0
        assert not any(k.startswith("async/") for k in b)  # a synchronous run says nothing of overlap
    a = policy(tmp_path / "whole", 3)
    for other in ("sync", "s0"):
        b = policy(tmp_path / other, 3)
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("mode, bound", [("one_step", 1), ("streaming", 2)])
def test_staleness_reaches_its_bound_and_never_passes_it(setup, tmp_path, mode, bound):
    metrics = run(setup, tmp_path / mode, 5, f"trainer.async_mode={mode}", f"rollout.max_staleness={bound}")
    ages = [m["async/staleness_max"] for m in metrics]
    # step s is trained by policy s - 1; its groups were admitted under policy max(0, s - 1 - bound)
    assert all(age <= min(s - 1, bound) for s, age in zip(range(1, 6), ages))
    if mode == "one_step":  # no update reaches a group in flight: every token exactly one update old
        assert ages == [0, 1, 1, 1, 1]
    else:  # an update can land before a group's first token (a loaded machine): younger, never older
        assert max(ages) == bound
    assert all(m["async/staleness_mean"] <= bound for m in metrics)
    assert metrics[0]["critic/score/mean"] == run(setup, tmp_path / "sync", 1)[0]["critic/score/mean"]
    # a batch from an older policy: pi_old is recomputed and the gap to the sampler is measured
    assert all("training/rollout_probs_diff_mean" in m for m in metrics)


def test_a_fractional_bound_starts_that_share_of_the_next_steps_groups_early(setup, tmp_path):
    """verl's staleness_threshold=0.5: half of the next step's 8 groups may start under the policy
    before the one that trains them, the other half waits for the update; one update old at most."""
    metrics = run(setup, tmp_path / "half", 5, "trainer.async_mode=streaming", "rollout.max_staleness=0.5")
    assert all(m["async/staleness_max"] <= 1 for m in metrics)
    assert all(m["async/stale_sequences"] <= 0.5 for m in metrics)
    assert metrics[0]["async/stale_sequences"] == 0  # step 1 is trained by the policy that sampled it
    assert max(m["async/stale_sequences"] for m in metrics) > 0  # the early half did start early
    assert metrics[0]["critic/score/mean"] == run(setup, tmp_path / "sync", 1)[0]["critic/score/mean"]


def test_a_step_admitted_in_parts_samples_what_it_would_in_one_call():
    engine = tiny_engine()
    params = SamplingParams(n=2, max_tokens=12, seed=5)
    whole = GroupStream(engine, version=0, in_flight_updates=True, deadline_s=120)
    try:
        whole.submit([prompt(0), prompt(1), prompt(2)], params, first_group=3)
        expected, _ = whole.take([3, 4, 5])
    finally:
        whole.close()
    parts = GroupStream(engine, version=0, in_flight_updates=True, deadline_s=120)
    try:
        parts.submit([prompt(0)], params, first_group=3)
        parts.submit([prompt(1), prompt(2)], params, first_group=3, offset=1)
        got, _ = parts.take([3, 4, 5])
    finally:
        parts.close()
    assert [g.rollouts.response_ids for g in got] == [g.rollouts.response_ids for g in expected]
    assert [g.rollouts.group_ids for g in got] == [g.rollouts.group_ids for g in expected]


KILLED = """
import sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from rl_run import config
from hybridflow.controller.trainer import RLTrainer
RLTrainer(config(Path({setup!r}), Path({run!r}), *{args!r})).fit()
"""


def whole_then_killed(setup, tmp_path, args):
    """The run with `args` uninterrupted in tmp_path/whole, then again in tmp_path/killed in a process
    of its own, killed with SIGKILL once step 2 is logged (its checkpoint written first: later steps'
    groups were admitted and generating). Returns the killed run's directory."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    RLTrainer(config(setup, tmp_path / "whole", *args)).fit()
    run_dir = tmp_path / "killed"
    script = tmp_path / "train.py"
    script.write_text(
        KILLED.format(tests=str(Path(__file__).parent), setup=str(setup), run=str(run_dir), args=args)
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    process = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env
    )
    deadline = time.monotonic() + 240
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.001)
    process.send_signal(signal.SIGKILL)
    process.wait()
    return run_dir


@pytest.fixture(scope="module")
def long_tail_setup(setup, tmp_path_factory):
    """The setup's run with 40 of the model's ids as end-of-sequence besides the tokenizer's: response
    lengths geometric (mean ~6, capped at 24), so a step's groups finish at different engine steps."""
    root = tmp_path_factory.mktemp("rl-long-tail")
    shutil.copytree(setup, root, dirs_exist_ok=True)
    path = root / "model" / "generation_config.json"
    generation = json.loads(path.read_text())
    eos = generation["eos_token_id"]
    generation["eos_token_id"] = [*(eos if isinstance(eos, list) else [eos]), *range(150, 190)]
    path.write_text(json.dumps(generation))
    return root


def test_kill_9_in_streaming_mode_resumes_the_groups_in_flight_exactly(long_tail_setup, tmp_path):
    """Streaming with partial rollouts, its engine pausing for the trainer where its own steps say:
    the run is the same every time, so the one resumed after a SIGKILL is the uninterrupted one,
    metrics and weights, sequences cut by a weight update and validations in between included."""
    setup = long_tail_setup
    args = ["trainer.total_training_steps=6", "trainer.val_before_train=false", "trainer.save_freq=1",
            "trainer.async_mode=streaming", "rollout.max_staleness=1", "data.max_response_tokens=24",
            f"data.val_files=[{setup / 'prompts.jsonl'}]", "data.max_val_prompts=6",
            "trainer.test_freq=2"]  # fmt: skip
    run_dir = whole_then_killed(setup, tmp_path, args)
    assert read_metrics(run_dir)[-1]["step"] < 6  # killed mid-run
    RLTrainer(config(setup, run_dir, *args)).fit()
    whole, resumed = read_metrics(tmp_path / "whole"), read_metrics(run_dir)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4, 5, 6]
    assert max(m["async/partial_sequences"] for m in whole) > 0  # sequences went on across an update
    assert sum(any(k.startswith("val-core/") for k in m) for m in whole) == 3  # validations between
    assert_same_run(whole, resumed)
    a, b = policy(tmp_path / "whole", 6), policy(run_dir, 6)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_run_that_keeps_the_kv_across_updates_prefills_nothing_again(long_tail_setup, tmp_path, capsys):
    """rollout.keep_kv_on_weight_update: the sequences continued across an update are not prefilled
    again (the recomputing run prefills them); both runs are the same until a sequence crosses an
    update, and differ from there (the kept K/V were computed with the older weights). The guard's
    numerics gap leaves continued sequences out, so it stays at zero. A resume says that it recomputes."""
    args = ["trainer.async_mode=streaming", "rollout.max_staleness=1", "data.max_response_tokens=48"]
    keep = "rollout.keep_kv_on_weight_update=true"
    kept = run(
        long_tail_setup,
        tmp_path / "kept",
        5,
        *args,
        keep,
        "trainer.save_freq=1",
        "trainer.keep_last_checkpoints=5",
    )
    redone = run(long_tail_setup, tmp_path / "redone", 5, *args, "trainer.save_freq=-1")
    crossed = [i for i, m in enumerate(redone) if m["async/partial_sequences"] > 0]
    assert crossed and crossed[0] < 4  # (steps 4 and 5 with these seeds)
    assert [m["async/recomputed_tokens"] for m in kept] == [0] * 5
    assert [m["async/recomputed_tokens"] > 0 for m in redone] == [i in crossed for i in range(5)]
    for i in range(crossed[0] + 1):
        same = {k: v for k, v in kept[i].items() if not k.startswith(NOT_COMPARED)}
        assert (same == {k: redone[i].get(k) for k in same}) == (i < crossed[0]), i
    assert all(m.get("training/rollout_probs_diff_fresh_max", 0) < 1e-6 for m in kept + redone)
    # the tokens sampled over kept K/V: their sampler's probabilities are not the trainer's, measured
    cost = [m.get("training/rollout_probs_diff_kept_kv_max") for m in kept]
    assert all(c is not None and c < 0.1 for i, c in enumerate(cost) if i in crossed)
    assert max(c for c in cost if c is not None) > 1e-4  # (1.4e-3 at step 5 with these seeds)
    assert not any("training/rollout_probs_diff_kept_kv_max" in m for m in redone)
    # resumed where sequences were in flight, their K/V are recomputed, and the run says so
    for step in range(crossed[0] + 1, 6):
        shutil.rmtree(tmp_path / "kept" / "checkpoints" / f"global_step_{step}")
    capsys.readouterr()
    run(long_tail_setup, tmp_path / "kept", 5, *args, keep, "trainer.save_freq=-1")
    said = capsys.readouterr().out
    assert f"in flight at global_step_{crossed[0]} go on with their K/V recomputed" in said


def assert_same_run(whole: list[dict], resumed: list[dict]) -> None:
    for a, b in zip(whole, resumed, strict=True):
        # a continued sample's next token comes from a prefill, not a decode step: its log-prob (the
        # sampler's, not the trainer's) differs in the last bits; the tokens and all training do not
        gaps = [k for k in a if k.startswith("training/rollout_probs_diff")]
        same = {k: v for k, v in a.items() if not k.startswith(NOT_COMPARED) and k not in gaps}
        assert same == {k: b[k] for k in same}, a["step"]
        assert all(abs(a[k] - b[k]) < 1e-7 for k in gaps)


def test_kill_9_in_one_step_mode_resumes_the_groups_in_flight_exactly(setup, tmp_path):
    """A checkpoint keeps the groups admitted and not yet trained on (one_step: the next step's,
    finished, and the one after's, started): the resumed run is the uninterrupted one, metrics
    and weights."""
    args = ["trainer.total_training_steps=5", "trainer.val_before_train=false", "trainer.save_freq=1",
            "trainer.async_mode=one_step"]  # fmt: skip
    run_dir = whole_then_killed(setup, tmp_path, args)
    resumed_from = max(int(d.name.rsplit("_", 1)[1]) for d in (run_dir / "checkpoints").glob("global_step_*"))
    assert resumed_from < 5
    state = json.loads(
        (run_dir / "checkpoints" / f"global_step_{resumed_from}" / "trainer_state.json").read_text()
    )
    kept = {int(g) for g in state["in_flight"]}
    per_step = config(setup, run_dir, *args).data.prompts_per_step  # group ids: (step - 1) * per_step + i
    next_step = set(range(resumed_from * per_step, (resumed_from + 1) * per_step))
    assert next_step <= kept  # one_step: the next step's groups had all finished before the update
    assert all(s["finish"] for g in next_step for s in state["in_flight"][str(g)])
    RLTrainer(config(setup, run_dir, *args)).fit()
    whole, resumed = read_metrics(tmp_path / "whole"), read_metrics(run_dir)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4, 5]
    assert_same_run(whole, resumed)
    a, b = policy(tmp_path / "whole", 5), policy(run_dir, 5)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_snapshot_of_groups_mid_generation_continues_to_the_same_tokens():
    """Half-generated samples, kept and handed to a new stream on a new engine (the same weights),
    go on to exactly the tokens of an uninterrupted run, with their log-probs and versions."""
    params = SamplingParams(n=3, max_tokens=300, seed=11)
    whole = GroupStream(tiny_engine(), version=0, in_flight_updates=True, deadline_s=120)
    try:
        whole.submit([prompt(0), prompt(1)], params, first_group=0)
        expected, _ = whole.take([0, 1])
    finally:
        whole.close()
    engine = tiny_engine()
    cut = GroupStream(engine, version=0, in_flight_updates=True, deadline_s=120)
    try:
        cut.submit([prompt(0), prompt(1)], params, first_group=0)
        deadline = time.monotonic() + 60
        while generated(engine) < 40 and time.monotonic() < deadline:
            time.sleep(0.001)
        taken = cut.snapshot()
        saved = json.loads(json.dumps(taken))  # as a checkpoint stores it
        while generated(engine) < 80 and time.monotonic() < deadline:
            time.sleep(0.001)
    finally:
        cut.close()
    assert taken == saved  # copies: generation going on does not reach into a snapshot being written
    lengths = [len(s["ids"]) for g in saved.values() for s in g]
    assert saved.keys() == {"0", "1"} and min(lengths) > 0 and max(lengths) < 300  # cut mid-way
    resumed = GroupStream(tiny_engine(), version=0, in_flight_updates=True, deadline_s=120, resume=saved)
    try:
        resumed.submit([prompt(0), prompt(1)], params, first_group=0)
        got, _ = resumed.take([0, 1])
    finally:
        resumed.close()
    for a, b in zip(expected, got, strict=True):
        assert a.rollouts.response_ids == b.rollouts.response_ids
        assert a.rollouts.policy_versions == b.rollouts.policy_versions
        for x, y in zip(a.rollouts.response_logprobs, b.rollouts.response_logprobs, strict=True):
            assert len(x) == len(y) and max(abs(u - v) for u, v in zip(x, y)) < 1e-5
    # on other weights (policy 1) the kept tokens stay, with their version; only the rest is new
    other = Engine(
        from_hf_model(tiny_model("qwen2", seed=4)).eval(),
        eos_token_ids=[],
        config=EngineConfig(max_context_tokens=4096, share_weights=False),
    )
    moved = GroupStream(other, version=1, in_flight_updates=True, deadline_s=120, resume=saved)
    try:
        moved.submit([prompt(0), prompt(1)], params, first_group=0)
        went_on, _ = moved.take([0, 1])
    finally:
        moved.close()
    for g, group in zip(("0", "1"), went_on, strict=True):
        for kept, ids, versions in zip(saved[g], group.rollouts.response_ids, group.rollouts.policy_versions):
            n = len(kept["ids"])
            assert ids[:n] == kept["ids"] and len(ids) == 300
            assert versions == [0] * n + [1] * (300 - n)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.max_staleness=2"], "set trainer.async_mode=streaming"),
        (["trainer.async_mode=one_step", "rollout.max_staleness=2"], "one update late"),
        (
            ["trainer.async_mode=streaming", "resources.num_workers=2", "rollout.tensor_parallel_size=2"],
            "rollout.tensor_parallel_size=1",
        ),
        (["trainer.async_mode=streaming", "rollout.backend=hf"], "built-in engine"),
        (["trainer.async_mode=sometimes"], "async_mode='sometimes'"),
        (["rollout.pause_for_training=true"], "nothing overlapped"),
        (["trainer.async_mode=one_step", "rollout.pause_for_training=true"], "nothing overlapped"),
        (["rollout.keep_kv_on_weight_update=true"], "async_mode=off none is in flight at an update"),
        (
            [
                "trainer.async_mode=streaming",
                "rollout.pause_for_training=true",
                "resources.rollout_workers=1",
            ],
            "devices of their own",
        ),
    ],
)
def test_what_an_asynchronous_run_cannot_do_is_named(setup, tmp_path, overrides, message):
    with pytest.raises(UserError, match=message):
        RLTrainer(config(setup, tmp_path, *overrides))


# ---- the stream itself, on a tiny engine ----------------------------------------------------------
def tiny_engine():
    model = from_hf_model(tiny_model("qwen2", seed=3)).eval()
    # no stop token: every sample runs to max_tokens
    return Engine(model, eos_token_ids=[], config=EngineConfig(max_context_tokens=4096, share_weights=False))


def prompt(i):
    return Prompt(i, list(b"question %d" % i), "synthetic")


def generated(engine) -> int:
    return max((s.num_generated for group in list(engine._requests.values()) for s in group), default=0)


def test_a_group_interrupted_by_a_weight_update_carries_both_versions_and_their_log_probs():
    engine = tiny_engine()
    before = {k: v.detach().clone() for k, v in engine.model.named_parameters()}
    stream = GroupStream(engine, version=0, in_flight_updates=True, deadline_s=120)
    try:
        stream.submit([prompt(0)], SamplingParams(n=2, max_tokens=1500, seed=7), first_group=0)
        deadline = time.monotonic() + 60
        while generated(engine) < 16 and time.monotonic() < deadline:
            time.sleep(0.001)
        generator = torch.Generator().manual_seed(0)

        def write(engine):  # a new policy: every weight moved
            engine.update_weights(
                (k, v + 0.05 * torch.randn(v.shape, generator=generator)) for k, v in before.items()
            )

        stream.update_weights(write, version=1)
        (group,), _ = stream.take([0])
    finally:
        stream.close()
    r = group.rollouts
    for versions, ids in zip(r.policy_versions, r.response_ids):
        assert len(versions) == len(ids) == 1500
        first_new = versions.index(1)  # in order: the old policy's tokens, then the new one's
        assert (
            16 <= first_new < 1500 and set(versions[:first_new]) == {0} and set(versions[first_new:]) == {1}
        )
    # each token's log-prob is its own policy's: recompute with the old and the new weights
    after = {k: v.detach().clone() for k, v in engine.model.named_parameters()}
    model = from_hf_model(tiny_model("qwen2", seed=3)).eval()
    for weights, version in ((before, 0), (after, 1)):
        model.load_state_dict(weights, strict=False)
        with torch.no_grad():
            logp, _ = packed_response_logprobs(
                model, r.prompt_ids, r.response_ids, device=torch.device("cpu"), compute_dtype="float32"
            )
        for i, versions in enumerate(r.policy_versions):
            mine = torch.tensor([v == version for v in versions])
            gap = (logp[i, :1500][mine] - torch.tensor(r.response_logprobs[i])[mine]).abs().max()
            assert gap < 1e-4, (version, gap)


def test_an_engine_pausing_for_training_stops_where_its_own_steps_say():
    """Step 1's groups (8 tokens) beside step 2's (300): the engine pauses in the step where step 1's
    last sample finishes, step 2's samples cut there, the same in every run (its K/V pool kept or
    freed meanwhile); a validation batch runs alone on the paused engine (step 2's samples set aside)
    and leaves it paused; after the update step 2 goes on with the new policy."""

    def lengths(engine):
        return sorted(s.num_generated for group in list(engine._requests.values()) for s in group)

    val_params = SamplingParams(n=1, max_tokens=30, seed=2)
    alone = tiny_engine().generate([prompt(4).token_ids], val_params)
    runs = []
    for free_cache in (False, True):  # the second time its K/V pool freed while paused, as on a GPU
        engine = tiny_engine()
        before = {k: v.detach().clone() for k, v in engine.model.named_parameters()}
        stream = GroupStream(
            engine, version=0, in_flight_updates=True, deadline_s=120, pause_for_training=True,
            free_cache_while_paused=free_cache,
        )  # fmt: skip
        try:
            stream.submit([prompt(0), prompt(1)], SamplingParams(n=2, max_tokens=8, seed=1), first_group=0)
            stream.submit([prompt(2), prompt(3)], SamplingParams(n=2, max_tokens=300, seed=1), first_group=2)
            time.sleep(0.2)
            assert set(lengths(engine)) <= {0}  # nothing generated before the trainer asks
            stream.run_until([0, 1])
            step1, _ = stream.take([0, 1])
            cut = lengths(engine)
            time.sleep(0.2)
            assert lengths(engine) == cut and len(cut) == 4 and 0 < cut[0] <= cut[-1] < 300  # paused
            assert engine.asleep == free_cache
            validation = stream.generate_now([prompt(4)], val_params)
            assert validation.response_ids == [g.token_ids for g in alone]  # as on an idle engine
            time.sleep(0.2)
            assert lengths(engine) == cut  # step 2's samples set aside meanwhile, and paused after it
            moved_weights = [(k, v + 0.05) for k, v in before.items()]
            stream.update_weights(lambda engine, w=moved_weights: engine.update_weights(w), version=1)
            stream.run_until([2, 3])
            step2, _ = stream.take([2, 3])
            idle = stream.take_idle_seconds()
        finally:
            stream.close()
        assert not engine.paused  # left running for whatever uses the engine after the stream
        assert idle >= 0.6  # the three sleeps above, paused
        assert [len(ids) for g in step1 for ids in g.rollouts.response_ids] == [8] * 4
        for versions in (v for g in step2 for v in g.rollouts.policy_versions):
            assert len(versions) == 300 and versions.index(1) in cut
        runs.append((cut, [g.rollouts.response_ids for g in step2]))
    assert runs[0] == runs[1]  # the same run, K/V kept or recomputed


def test_the_trainer_takes_every_admitted_group_even_when_later_ones_finish_first():
    stream = GroupStream(tiny_engine(), version=0, in_flight_updates=True, deadline_s=120)
    try:
        stream.submit([prompt(0)], SamplingParams(n=2, max_tokens=800, seed=1), first_group=0)  # slow
        stream.submit([prompt(1), prompt(2)], SamplingParams(n=2, max_tokens=8, seed=1), first_group=1)
        groups, _ = stream.take([0, 1, 2])
    finally:
        stream.close()
    assert groups[0].finished_at > max(g.finished_at for g in groups[1:])  # the slow one was waited for
    assert [g.rollouts.group_ids[0] for g in groups] == [0, 1, 2]
    assert [len(ids) for g in groups for ids in g.rollouts.response_ids] == [800, 800, 8, 8, 8, 8]


def test_generation_beside_the_stream_uses_the_same_seeds_as_a_batch():
    engine = tiny_engine()
    params = SamplingParams(n=2, max_tokens=12, seed=5)
    expected = engine.generate([prompt(0).token_ids, prompt(1).token_ids], params)
    stream = GroupStream(engine, version=0, in_flight_updates=True, deadline_s=120)
    try:
        got = stream.generate_now([prompt(0), prompt(1)], params)
    finally:
        stream.close()
    assert got.response_ids == [g.token_ids for g in expected]
    assert got.response_logprobs == [g.logprobs for g in expected]


def test_validation_beside_more_finished_groups_than_threads_does_not_starve_the_engine():
    """Found on the H200 (one_step, 32 groups a step, validation every 5 steps): groups that finished
    while validation generated once waited for scoring in threads the engine's steps needed, and the
    run hung. Groups are now scored where they are handed over, never in the engine's stream; 40
    groups finish here while validation generates."""
    engine = tiny_engine()
    stream = GroupStream(engine, version=0, in_flight_updates=True, deadline_s=30)
    try:
        stream.submit(
            [prompt(i) for i in range(40)], SamplingParams(n=1, max_tokens=2, seed=1), first_group=0
        )
        val = stream.generate_now([prompt(100)], SamplingParams(n=1, max_tokens=400, seed=2))
        groups, _ = stream.take(list(range(40)))
    finally:
        stream.close()
    assert [len(ids) for ids in val.response_ids] == [400]
    assert [g.rollouts.group_ids[0] for g in groups] == list(range(40))


def test_multi_turn_episodes_stream_too_and_staleness_0_is_the_synchronous_run(tmp_path):
    """Environment episodes (guess_number; its answers masked out) through the stream: with
    staleness 0 the synchronous run's metrics and weights; with one_step every sampled token one
    update old and the environment's tokens without a version; streaming at staleness 1, its engine
    pausing for the trainer between episodes' turns, within its bound."""
    from agent_helpers import write_guess_game

    from hybridflow.config import load_config

    write_guess_game(tmp_path)
    base = [
        f"model.path={tmp_path / 'model'}", f"data.train_files=[{tmp_path / 'rows.jsonl'}]",
        "data.max_response_tokens=48", "data.prompts_per_step=4", "rollout.samples_per_prompt=4",
        "rollout.agent.loop=environment", "rollout.agent.environment=guess_number", "rollout.agent.max_turns=3",
        "rollout.agent.max_tokens_per_turn=8", "actor.compute_dtype=float32", "actor.optim.lr=1e-2",
        "reward.num_workers=0", "trainer.logger=[jsonl]", "trainer.total_training_steps=3",
        "trainer.val_before_train=false",
    ]  # fmt: skip
    results = {}
    for name, extra in (
        ("sync", []),  # the reference: each step's episodes run as one batch
        ("s0", ["trainer.async_mode=streaming", "rollout.max_staleness=0"]),
        ("one", ["trainer.async_mode=one_step"]),
        ("s1", ["trainer.async_mode=streaming", "rollout.max_staleness=1"]),  # pausing for the trainer
    ):
        c = load_config(None, [*base, *extra, f"trainer.run_dir={tmp_path / name}"])
        whole_batch_fit(c) if name == "sync" else RLTrainer(c).fit()
        results[name] = read_metrics(tmp_path / name)
    for a, b in zip(results["sync"], results["s0"], strict=True):
        # which turns share an engine step depends on when the environment answered, in either mode:
        # the engine's log-probs of the same tokens then differ in the last bits (~1e-12)
        gaps = [k for k in a if k.startswith("training/rollout_probs_diff")]
        same = {k: v for k, v in a.items() if not k.startswith(NOT_COMPARED) and k not in gaps}
        assert same == {k: b[k] for k in same}
        assert all(abs(a[k] - b[k]) < 1e-9 for k in gaps)
    a, b = policy(tmp_path / "sync", 3), policy(tmp_path / "s0", 3)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [m["async/staleness_max"] for m in results["one"]] == [0.0, 1.0, 1.0]
    assert [m["async/staleness_mean"] for m in results["one"]] == [0.0, 1.0, 1.0]  # -1 tokens left out
    assert all(m["agent/episodes"] == 16 for m in results["one"])
    assert all(m["agent/episodes"] == 16 and m["async/staleness_max"] <= 1 for m in results["s1"])


def test_off_is_off_though_yaml_reads_it_as_false(setup, tmp_path):
    assert config(setup, tmp_path, "trainer.async_mode=off").trainer.async_mode == "off"
    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer:\n  async_mode: off\n")
    from hybridflow.config import load_config

    assert load_config(str(recipe)).trainer.async_mode == "off"


def test_the_probability_gap_guard_looks_only_at_tokens_of_the_training_policy(setup, tmp_path):
    """A batch one update old differs from the trainer by that update: the guard that catches
    numerics bugs must not stop the run for it, and still sees the fresh tokens. (one_step: which
    tokens are fresh does not depend on timing, as it would with updates in flight.)"""
    metrics = run(
        setup, tmp_path / "run", 4, "trainer.async_mode=one_step", "trainer.guards.max_probs_gap=0.0002"
    )
    assert metrics[0]["training/rollout_probs_diff_fresh_mean"] < 1e-5  # step 1: every token fresh
    assert max(m["training/rollout_probs_diff_mean"] for m in metrics[1:]) > 0.0002  # older tokens drifted
    assert all("training/rollout_probs_diff_fresh_mean" not in m for m in metrics[1:])  # none fresh


def test_each_token_counts_in_the_gap_of_the_policy_and_kv_that_sampled_it():
    """Versions per token (-1: not sampled), trained by policy 1: a sequence continued across the
    update has older tokens (the whole batch's gap only) and tokens of policy 1 over kept K/V."""
    versions = [[0, 0, 1], [1, 1, -1], [0, -1, 0]]
    rollouts = Rollouts([[5]] * 3, [[7, 7, 7], [7, 7, 7], [7, 7, 7]], [[0.0] * 3] * 3, ["stop"] * 3,
                        [0, 0, 1], [None] * 3, loss_masks=[[1, 1, 1], [1, 1, 0], [1, 0, 1]],
                        policy_versions=versions)  # fmt: skip
    mask = torch.tensor(rollouts.masks(), dtype=torch.float32)  # [3, 3]
    C, F, K = GapScope.COUNTED, GapScope.FRESH, GapScope.KEPT_KV
    kept = gap_scopes(rollouts, mask, trained_by=1, kv_kept=True)
    assert kept.tolist() == [[C, C, K], [F, F, 0], [C, 0, C]]
    redone = gap_scopes(rollouts, mask, trained_by=1)  # K/V recomputed: policy 1's tokens over its own
    assert redone.tolist() == [[C, C, F], [F, F, 0], [C, 0, C]]
    assert gap_scopes(rollouts, mask, trained_by=None).tolist() == [[C, C, C], [C, C, 0], [C, 0, C]]


def test_bypass_mode_trains_against_the_samplers_own_log_probs(setup, tmp_path):
    metrics = run(
        setup,
        tmp_path / "run",
        3,
        "trainer.async_mode=one_step",
        "algorithm.rollout_correction.bypass_mode=true",
    )
    # pi_old is the sampler's: nothing recomputed, and the first mini-batch's KL is its gap to the
    # trainer (one update old), reported apart from the recomputation check
    assert all("timing_s/old_log_prob" not in m for m in metrics)
    assert metrics[1]["training/first_minibatch_ppo_kl_to_rollout"] > 0.0
    assert all("training/first_minibatch_ppo_kl" not in m for m in metrics)
    # the rollout/trainer gap is still measured, by the update's forward before its optimizer step,
    # not read off pi_old (the sampler's own: zero by construction), as with it recomputed above
    assert metrics[0]["training/rollout_probs_diff_fresh_mean"] < 1e-5  # step 1: every token fresh
    assert min(m["training/rollout_probs_diff_mean"] for m in metrics[1:]) > 0.0002  # one update old
    assert all("training/rollout_probs_diff_fresh_mean" not in m for m in metrics[1:])


def test_a_pausing_engine_that_cannot_hold_what_admission_lets_in_says_what_to_raise():
    """At staleness 3 a step's 256 sequences and the next three steps' are admitted together: an
    engine batch of 256 would leave them waiting instead of beside the tail (the H200's 1.5x)."""
    from hybridflow.config import load_config
    from hybridflow.stream.admission import engine_batch_note

    base = ["data.prompts_per_step=32", "rollout.samples_per_prompt=8", "trainer.async_mode=streaming"]
    note = engine_batch_note(load_config(None, [*base, "rollout.max_staleness=3"]), on_gpu=True)
    assert "rollout.max_batch_sequences=1024 lets" in note and "max_batch_sequences=256 of them" in note
    half = engine_batch_note(load_config(None, [*base, "rollout.max_staleness=0.5"]), on_gpu=True)
    assert "rollout.max_batch_sequences=384 lets" in half
    for quiet, on_gpu in [
        ([*base, "rollout.max_staleness=3", "rollout.max_batch_sequences=1024"], True),
        ([*base, "rollout.max_staleness=3"], False),  # on a CPU decode is compute-bound: no gain to name
        ([*base, "rollout.max_staleness=3", "rollout.pause_for_training=false"], True),
        (["data.prompts_per_step=32", "rollout.samples_per_prompt=8"], True),  # synchronous
    ]:
        assert engine_batch_note(load_config(None, quiet), on_gpu=on_gpu) is None, quiet


# DAPO with a reward most groups agree on (a byte-level tiny model rarely writes an 'a'): steps refill
# themselves over rounds of 4 prompts; ReMax: a greedy baseline group per prompt
SOMETIMES_A = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n" \
    "    return float('a' in solution_str or 'b' in solution_str)\n"  # fmt: skip
ADMISSION_POLICIES = {
    "dapo": ["reward.custom_function_path=sometimes_a.py", "algorithm.filter_groups.enable=true",
             "algorithm.filter_groups.prompts_per_round=4", "algorithm.filter_groups.max_generation_rounds=3"],
    "remax": ["algorithm.adv_estimator=remax", "reward.custom_function_path=sometimes_a.py"],
}  # fmt: skip


@pytest.mark.parametrize("rule", list(ADMISSION_POLICIES))
def test_dapo_and_remax_stream_and_staleness_0_is_their_synchronous_run(setup, tmp_path, rule):
    """DAPO's refill and ReMax's greedy baseline are admission policies of the one road: streamed at
    staleness 0 they are the synchronous run bit for bit; one step off they train within the bound."""
    (tmp_path / "reward.py").write_text(SOMETIMES_A)
    overrides = [o.replace("sometimes_a.py", str(tmp_path / "reward.py")) for o in ADMISSION_POLICIES[rule]]
    sync = run(setup, tmp_path / "sync", 3, *overrides, whole_batches=True)
    streamed = run(
        setup, tmp_path / "s0", 3, *overrides, "trainer.async_mode=streaming", "rollout.max_staleness=0"
    )
    for a, b in zip(sync, streamed, strict=True):
        assert {k: v for k, v in a.items() if not k.startswith(NOT_COMPARED)} == {
            k: v for k, v in b.items() if not k.startswith(NOT_COMPARED)
        }
    a, b = policy(tmp_path / "sync", 3), policy(tmp_path / "s0", 3)
    assert all(torch.equal(a[k], b[k]) for k in a)
    if rule == "dapo":  # the refill ran: some step took more than one round
        assert max(m["dapo/generation_rounds"] for m in sync) > 1
    else:  # the greedy pass ran and scored (the same in both: the metrics above are equal)
        assert max(m["remax/greedy_score_mean"] for m in sync) > 0
    one_step = run(setup, tmp_path / "one", 3, *overrides, "trainer.async_mode=one_step")
    assert all(m["async/staleness_max"] <= 1 for m in one_step)
    assert one_step[0]["critic/score/mean"] == sync[0]["critic/score/mean"]
    if rule == "dapo":
        assert all(m["dapo/kept_groups"] <= 8 for m in one_step)


@pytest.mark.parametrize("mode", ["off", "one_step"])
def test_steps_driven_without_fit_take_their_batches(setup, tmp_path, mode):
    """bench/vs_trl's way: `trainer.step = s; trainer.train_step()` with no fit(): the stream admits
    each step's groups all the same (up to the configured last step), as fit's steps would."""
    whole = run(setup, tmp_path / "fit", 2, f"trainer.async_mode={mode}")
    trainer = RLTrainer(
        config(
            setup,
            tmp_path / "driven",
            "trainer.total_training_steps=2",
            f"trainer.async_mode={mode}",
            "trainer.watchdog_s=120",
        )  # a batch that never comes fails in 2 minutes, not an hour
    )
    trainer.run_dir.mkdir(parents=True, exist_ok=True)
    for step in (1, 2):
        trainer.step = step
        metrics = trainer.train_step()
        assert metrics["critic/score/mean"] == whole[step - 1]["critic/score/mean"]
    trainer.close()
