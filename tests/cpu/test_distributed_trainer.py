"""The trainer over two Ray workers (gloo, FSDP2 over both) against the in-process single worker:
the same data, the same step, the same weights; checkpoints written by two ranks resume on one and
the other way round; Ulysses sequence parallelism over the two gives the same step too."""

import json
import os
import signal

import pytest
import torch
from safetensors.torch import load_file

ray = pytest.importorskip("ray")

from local_ray import start_local_ray  # noqa: E402
from rl_run import config, read_metrics  # noqa: E402

from hybridflow.controller.trainer import RLTrainer  # noqa: E402
from hybridflow.controller.worker_models import WorkerLayout, sharded_policy_path, sharded_reference_path  # noqa: E402
from hybridflow.models.checkpoint_export import export_checkpoint  # noqa: E402

# actor, reference (KL loss) and critic (GAE) all sharded; micro-batches small enough that ranks run
# different numbers of them
ROLES = [
    "algorithm.adv_estimator=gae",
    "critic.optim.lr=5e-3",
    "actor.use_kl_loss=true",
    "actor.max_tokens_per_microbatch=64",
    "critic.max_tokens_per_microbatch=64",
    "ref.max_tokens_per_microbatch=64",
    "trainer.save_freq=1",
    "trainer.keep_last_checkpoints=2",
]
TWO = ["resources.device=cpu", "resources.num_workers=2"]
COMPARED = ["actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/vf_loss", "critic/score/mean",
            "response_length/mean"]  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    start_local_ray()
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def single(setup, tmp_path_factory):
    """Two steps in one process: what every distributed layout must reproduce."""
    run_dir = tmp_path_factory.mktemp("single") / "run"
    return run_dir, _train(setup, run_dir, 2)


def _train(setup, run_dir, steps, *extra):
    RLTrainer(config(setup, run_dir, *ROLES, f"trainer.total_training_steps={steps}", *extra)).fit()
    return {m["step"]: m for m in read_metrics(run_dir)}


def _policy(run_dir, step):
    return load_file(run_dir / "checkpoints" / f"global_step_{step}" / "policy" / "model.safetensors")


def _assert_same_step(a, b):
    for key in COMPARED:
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


def _assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for name in a:
        # Adam divides by sqrt(v): last-bit differences of a two-rank gradient sum grow to ~1e-5
        torch.testing.assert_close(b[name], a[name], atol=1e-4, rtol=0, msg=name)


@pytest.mark.slow
def test_two_workers_train_as_one_and_checkpoints_move_between_them(setup, tmp_path, single):
    single_dir, single = single
    # two ranks take step 1; one worker resumes from their checkpoint and takes step 2
    two_then_one = _train(setup, tmp_path / "a", 1, *TWO)
    _assert_same_step(single[1], two_then_one[1])
    assert (tmp_path / "a/checkpoints/global_step_1/actor_state/.metadata").is_file()
    two_then_one |= _train(setup, tmp_path / "a", 2)
    _assert_same_step(single[2], two_then_one[2])
    _assert_same_weights(_policy(single_dir, 2), _policy(tmp_path / "a", 2))
    # one worker takes step 1; two ranks resume from its checkpoint and take step 2
    _train(setup, tmp_path / "b", 1)
    one_then_two = _train(setup, tmp_path / "b", 2, *TWO)
    _assert_same_step(single[2], one_then_two[2])
    _assert_same_weights(_policy(single_dir, 2), _policy(tmp_path / "b", 2))
    # the sharded critic is exported whole too
    critic = json.loads((tmp_path / "b/checkpoints/global_step_2/critic/config.json").read_text())
    assert critic["architectures"] == ["Qwen2ForTokenClassification"]
    # `hybridflow export` of that two-rank checkpoint: the weights from its shards, reloaded and checked
    export_checkpoint(tmp_path / "b", tmp_path / "b-export")
    _assert_same_weights(_policy(tmp_path / "b", 2), load_file(tmp_path / "b-export" / "model.safetensors"))
    # Ulysses: both ranks one sequence-parallel group (each keeps half of every micro-batch's tokens)
    ulysses = _train(setup, tmp_path / "sp", 2, *TWO, "actor.sequence_parallel_size=2")
    for step in (1, 2):
        _assert_same_step(single[step], ulysses[step])
    _assert_same_weights(_policy(single_dir, 2), _policy(tmp_path / "sp", 2))


@pytest.mark.slow
@pytest.mark.parametrize("trainers", [1, 2])
def test_rollout_on_its_own_worker_trains_as_one_process(setup, tmp_path, trainers, single):
    """Disaggregated: one worker trains (in process) or two (Ray, FSDP2), one Ray worker generates
    and receives the actor's weights by broadcast after each update — the same steps and weights
    as one colocated process."""
    single_dir, single = single
    workers = ["resources.device=cpu", f"resources.num_workers={trainers + 1}", "resources.rollout_workers=1"]
    if trainers == 1:  # stopped after step 1 and resumed: the loaded weights are broadcast too
        apart = _train(setup, tmp_path / "apart", 1, *workers)
        apart |= _train(setup, tmp_path / "apart", 2, *workers)
    else:
        apart = _train(setup, tmp_path / "apart", 2, *workers)
    for step in (1, 2):
        _assert_same_step(single[step], apart[step])
    _assert_same_weights(_policy(single_dir, 2), _policy(tmp_path / "apart", 2))


@pytest.mark.slow
@pytest.mark.parametrize("rollout_workers", [0, 1])
def test_a_policy_read_shard_by_shard_trains_as_one_process(setup, tmp_path, rollout_workers):
    """GRPO (no critic, a KL loss) on two training workers, each reading only its shards of the policy
    and the reference from the safetensors (parallel/sharded_load.py), never a whole copy: with the
    engines colocated (built to the policy's shape, filled by a first weight sync) or on a rollout
    worker — the same steps and weights as one process that loaded them whole."""
    grpo = ["algorithm.adv_estimator=grpo"]
    one = _train(setup, tmp_path / "one", 2, *grpo)
    workers = ["resources.device=cpu", f"resources.num_workers={2 + rollout_workers}",
               f"resources.rollout_workers={rollout_workers}"]  # fmt: skip
    c = config(setup, tmp_path / "apart", *ROLES, *grpo, *workers)
    layout = WorkerLayout.of(c, 2)
    assert sharded_policy_path(c, layout, 2) is not None and sharded_reference_path(c, layout) is not None
    apart = _train(setup, tmp_path / "apart", 2, *grpo, *workers)
    for step in (1, 2):
        for key in (k for k in COMPARED if not k.startswith("critic/vf")):
            assert apart[step][key] == pytest.approx(one[step][key], rel=1e-4, abs=1e-6), key
    _assert_same_weights(_policy(tmp_path / "one", 2), _policy(tmp_path / "apart", 2))


@pytest.mark.trials
def test_a_worker_killed_mid_step_stops_the_run_naming_its_checkpoint_and_it_resumes(setup, tmp_path, single):
    """One of two Ray workers is killed during step 2: the run stops with the rank and the checkpoint
    to go on from; the same command resumes there and ends as the uninterrupted run."""
    import threading
    import time

    from hybridflow.controller.worker_group import WorkerError

    _, single = single
    run = tmp_path / "killed"
    trainer = RLTrainer(
        config(setup, run, *ROLES, "trainer.total_training_steps=2", "trainer.save_freq=1", *TWO)
    )
    metrics = run / "metrics.jsonl"

    def kill_during_step_2():
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 1):
            time.sleep(0.01)
        ray.kill(trainer.workers.workers[1])

    threading.Thread(target=kill_during_step_2, daemon=True).start()
    with pytest.raises(
        WorkerError, match=r"worker rank 1 died(.|\n)*global_step_1; the same command resumes"
    ):
        trainer.fit()
    resumed = _train(setup, run, 2, *TWO)
    assert sorted(resumed) == [1, 2]
    _assert_same_step(single[2], resumed[2])


@pytest.mark.slow
def test_max_restarts_starts_again_from_the_latest_checkpoint_after_a_worker_dies(
    setup, tmp_path, single, capsys
):
    """trainer.max_restarts=1: the worker killed during step 2 ends that attempt with its rank; the
    run starts again from global_step_1 by itself and ends as the uninterrupted run."""
    import threading
    import time

    from hybridflow.controller.restarts import fit_with_restarts

    _, single = single
    run = tmp_path / "restarted"
    metrics = run / "metrics.jsonl"
    c = config(setup, run, *ROLES, "trainer.total_training_steps=2", "trainer.max_restarts=1", *TWO)
    attempts = []

    def kill_the_first_attempt_during_step_2(trainer):
        attempts.append(trainer)
        if len(attempts) > 1:
            return

        def kill():
            while not (metrics.is_file() and metrics.read_text().count("\n") >= 1):
                time.sleep(0.01)
            ray.kill(trainer.workers.workers[1])

        threading.Thread(target=kill, daemon=True).start()

    fit_with_restarts(c, started=kill_the_first_attempt_during_step_2)
    # the failed attempt gave its workers' CPUs back though its stream's close raised (a dead worker)
    alive = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
    assert alive == []
    out = capsys.readouterr().out
    assert len(attempts) == 2
    assert "worker rank 1 died" in out and "restart 1 of 1 (trainer.max_restarts)" in out
    assert "resumed from" in out and "global_step_1" in out
    rows = {m["step"]: m for m in read_metrics(run)}
    assert sorted(rows) == [1, 2]
    _assert_same_step(single[2], rows[2])


def _streamed_as_one_process(setup, tmp_path, single, workers):
    """Streaming at staleness 0 on `workers`: the steps and weights of one synchronous process; one_step
    trains one update late, its first batch the synchronous one."""
    single_dir, single = single
    streamed = _train(
        setup, tmp_path / "s0", 2, *workers, "trainer.async_mode=streaming", "rollout.max_staleness=0"
    )
    for step in (1, 2):
        _assert_same_step(single[step], streamed[step])
        assert streamed[step]["async/staleness_max"] == 0.0
    _assert_same_weights(_policy(single_dir, 2), _policy(tmp_path / "s0", 2))
    late = _train(setup, tmp_path / "one", 2, *workers, "trainer.async_mode=one_step")
    assert [late[s]["async/staleness_max"] for s in (1, 2)] == [0.0, 1.0]
    _assert_same_step(single[1], late[1])  # the first batch is the synchronous one


LORA = ["model.lora_rank=4", "model.lora_alpha=8", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.1",
        "trainer.guards.weight_sync_check=true", "trainer.save_freq=2"]  # fmt: skip


@pytest.fixture(scope="module")
def one_lora(setup, tmp_path_factory):
    """Two LoRA steps in one process: what LoRA over several workers must reproduce."""
    run_dir = tmp_path_factory.mktemp("one_lora") / "run"
    return run_dir, _train(setup, run_dir, 2, *LORA)


@pytest.mark.slow
@pytest.mark.parametrize(
    "workers",
    [
        ["resources.num_workers=2"],
        ["resources.num_workers=2", "resources.rollout_workers=1"],
        ["resources.num_workers=3", "resources.rollout_workers=1"],
    ],
    ids=["two_colocated", "one_trainer_one_rollout_worker", "two_trainers_one_rollout_worker"],
)
def test_lora_over_workers_trains_as_one_process(setup, tmp_path, one_lora, workers):
    """LoRA over workers: under FSDP2 over two training workers base and adapters are sharded alike
    and the reference is the same sharded model with its adapters off; the engines (each worker's
    own, or a rollout worker's, which starts from the base, by broadcast) are given the adapted
    layers' merged weights one gathered layer at a time, checked against the trainer's every step.
    The steps and weights of one process; the checkpoint holds one process's merged policy and PEFT
    adapter, and exports whole from the shards."""
    one_dir, one = one_lora
    two = _train(setup, tmp_path / "two", 2, *LORA, "resources.device=cpu", *workers)
    for step in (1, 2):
        _assert_same_step(one[step], two[step])
        assert two[step]["training/rollout_probs_diff_max"] < 1e-4  # the engine holds the trained policy
    assert two[2]["actor/kl_loss"] > 1e-6  # the adapters moved the policy off its base
    _assert_same_weights(_policy(one_dir, 2), _policy(tmp_path / "two", 2))
    adapter = "policy_adapter/adapter_model.safetensors"
    _assert_same_weights(
        *(load_file(run / "checkpoints/global_step_2" / adapter) for run in (one_dir, tmp_path / "two"))
    )
    export_checkpoint(tmp_path / "two", tmp_path / "export")  # the merged weights from the two ranks' shards
    _assert_same_weights(_policy(one_dir, 2), load_file(tmp_path / "export" / "model.safetensors"))


@pytest.mark.slow
def test_an_asynchronous_run_over_two_colocated_workers_trains_as_one_process(setup, tmp_path, single):
    """Asynchronous with two colocated Ray workers (FSDP2), each streaming groups on its own engine:
    the controller splits each step's groups over them, scores them as they arrive, and each worker
    writes its gathered weights into its engine between two of its steps. Staleness 0 (each engine
    pausing for its worker's training) is one synchronous process; one_step trains one update late,
    and its checkpoint after step 1 keeps step 2's groups, generated on both workers."""
    _streamed_as_one_process(setup, tmp_path, single, TWO)
    state = json.loads((tmp_path / "one/checkpoints/global_step_1/trainer_state.json").read_text())
    assert sorted(int(g) for g in state["in_flight"]) == list(range(8, 16))  # group ids of step 2
    assert all(len(state["in_flight"][str(g)]) == 4 for g in range(8, 16))  # each group's 4 samples


@pytest.mark.slow
def test_an_asynchronous_run_with_its_engine_on_a_rollout_worker(setup, tmp_path, single):
    """Disaggregated and asynchronous: the engine streams groups on a Ray rollout worker, the
    controller scores them as they arrive, weights are broadcast between two engine steps. With
    staleness 0 the steps and weights of one colocated process; one_step trains one update late."""
    single_dir, single = single
    workers = ["resources.device=cpu", "resources.num_workers=2", "resources.rollout_workers=1"]
    _streamed_as_one_process(setup, tmp_path, (single_dir, single), workers)
    # a fractional bound (verl's staleness_threshold): half of step 2's groups start early, on the
    # rollout worker too; step 1 is still the synchronous one
    half = _train(
        setup, tmp_path / "half", 2, *workers, "trainer.async_mode=streaming", "rollout.max_staleness=0.5"
    )
    assert half[1]["async/stale_sequences"] == 0.0 and 0.0 < half[2]["async/stale_sequences"] <= 0.5
    _assert_same_step(single[1], half[1])


@pytest.mark.slow
def test_a_rollout_worker_that_dies_is_replaced_and_its_groups_generated_again(
    setup, tmp_path, single, capsys
):
    """Two rollout workers, streaming at staleness 0. With step 2's groups in flight, rollout worker 1
    is killed: a new worker takes its place (the weight-sync group formed again, the current weights
    sent) and generates the groups it had not handed over with their own sampling streams, so step 2
    is still the one-process step, to the weights."""
    single_dir, single = single
    workers = ["resources.device=cpu", "resources.num_workers=3", "resources.rollout_workers=2"]
    run_dir = tmp_path / "run"
    trainer = RLTrainer(
        config(setup, run_dir, *ROLES, "trainer.total_training_steps=2", *workers,
               "trainer.async_mode=streaming", "rollout.max_staleness=0")
    )  # fmt: skip
    trainer.fit(max_steps=1, close=False)
    victim = ray.get(trainer.placement.rollout.workers[1].pid.remote())
    trainer.batches.start(stop_at=2)
    trainer.batches._admit()  # step 2's groups now (staleness 0 would at its take): half on each worker
    os.kill(victim, signal.SIGKILL)
    trainer.fit()
    metrics = {m["step"]: m for m in read_metrics(run_dir)}
    assert metrics[1]["async/rollout_workers_replaced"] == 0
    assert metrics[2]["async/rollout_workers_replaced"] == 1
    assert metrics[2]["async/groups_requeued"] >= 1  # killed with its groups running
    assert "rollout worker 1 died; replaced" in capsys.readouterr().out
    for step in (1, 2):
        _assert_same_step(single[step], metrics[step])
    _assert_same_weights(_policy(single_dir, 2), _policy(run_dir, 2))


@pytest.mark.slow
@pytest.mark.parametrize("rollout_tp", [1, 2])
def test_tensor_parallel_roles_over_two_workers_train_as_one_process(setup, tmp_path, single, rollout_tp):
    """actor.tensor_parallel_size=2: actor, reference and critic split over both Ray workers (heads,
    MLP channels, the vocabulary; the value head whole), the same rows on both ranks; the steps
    (policy, KL and value losses) and the weights of one process. rollout.tensor_parallel_size=2
    splits the engine over the same pair too (fed the actor's TP shards at each sync): the same."""
    single_dir, single = single
    tp = _train(setup, tmp_path / "tp", 2, *TWO, "actor.tensor_parallel_size=2",
                f"rollout.tensor_parallel_size={rollout_tp}")  # fmt: skip
    for step in (1, 2):
        _assert_same_step(single[step], tp[step])
    _assert_same_weights(_policy(single_dir, 2), _policy(tmp_path / "tp", 2))


@pytest.mark.slow
def test_an_engine_split_over_two_rollout_workers_trains_as_one_process(setup, tmp_path, single):
    """Disaggregated with rollout.tensor_parallel_size=2: one trainer, one engine split over two Ray
    rollout workers (each given the same prompts; the actor's rank 0 sends each only its slices of every
    layer, checked by the per-step weight check): the same steps and weights as one colocated process."""
    single_dir, single = single
    workers = ["resources.device=cpu", "resources.num_workers=3", "resources.rollout_workers=2"]
    apart = _train(setup, tmp_path / "apart", 2, *workers, "rollout.tensor_parallel_size=2")
    assert "each engine split over 2 workers" in (tmp_path / "apart" / "step_plan.txt").read_text()
    for step in (1, 2):
        _assert_same_step(single[step], apart[step])
    _assert_same_weights(_policy(single_dir, 2), _policy(tmp_path / "apart", 2))


@pytest.mark.slow
def test_an_engine_split_over_two_fsdp_workers_trains_as_one_process(setup, tmp_path, single):
    """rollout.tensor_parallel_size=2 with an FSDP2 actor (verl's usual layout: FSDP training, a TP
    engine): both ranks generate the same prompts with half the engine each, each trains its own share,
    every sync slices the gathered layers: the steps and the weights of one process."""
    single_dir, single = single
    split = _train(setup, tmp_path / "split", 2, *TWO, "rollout.tensor_parallel_size=2")
    assert "each engine split over 2 workers" in (tmp_path / "split" / "step_plan.txt").read_text()
    for step in (1, 2):
        _assert_same_step(single[step], split[step])
    _assert_same_weights(_policy(single_dir, 2), _policy(tmp_path / "split", 2))


MOE = ["actor.router_replay=R2", "actor.sequences_per_update=16"]


@pytest.fixture(scope="module")
def one_moe(setup, tmp_path_factory):
    """Three steps of a Qwen3-MoE policy in one process, every checkpoint kept: what its splits over
    workers reproduce. Returns (its overrides, run directory, metrics by step)."""
    from hybridflow.models import byte_tokenizer, save_hf, tiny_model

    root = tmp_path_factory.mktemp("moe")
    save_hf(tiny_model("qwen3_moe", seed=0), byte_tokenizer(), root / "model")
    moe = [f"model.path={root / 'model'}", *MOE]
    return moe, root / "one", _train(setup, root / "one", 3, *moe, "trainer.keep_last_checkpoints=3")


@pytest.mark.slow
def test_experts_split_over_two_workers_train_as_one_process(setup, tmp_path, one_moe):
    """actor.expert_parallel_size=2 on a Qwen3-MoE policy read from its safetensors shard by shard (each
    rank the experts it keeps): each Ray worker keeps 2 of the 4 experts of every MoE layer for the
    actor, the reference and the critic made from it (tokens sent to them by all-to-all; micro-batches
    as small as above, so one rank runs padding passes), FSDP2 for the rest: the steps and the weights
    of one process, and a checkpoint whose exported policy is whole and from which one process resumes.
    With router replay R2 and two mini-batches a step: each rank records its rows' experts in pi_old's
    pass and they come back to the controller in the batch's order."""
    moe, one_dir, one = one_moe
    c = config(setup, tmp_path / "ep", *ROLES, *moe, *TWO)  # every rank reads its own experts alone
    layout = WorkerLayout.of(c, 2)
    assert sharded_policy_path(c, layout, 2) is not None and sharded_reference_path(c, layout) is not None
    split = _train(setup, tmp_path / "ep", 2, *moe, *TWO, "actor.expert_parallel_size=2")
    assert "experts split over groups of 2 workers" in (tmp_path / "ep" / "step_plan.txt").read_text()
    for step in (1, 2):
        assert (
            one[step]["router_replay/recorded_fraction"]
            == split[step]["router_replay/recorded_fraction"]
            == 1
        )
        _assert_same_step(one[step], split[step])
    policy = _policy(tmp_path / "ep", 1)
    whole = {f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(4)}
    assert whole <= policy.keys()
    # after step 1's two updates (Adam at lr 1e-2 grows the two-rank sums' last bits to ~1e-4 by step 2)
    _assert_same_weights(_policy(one_dir, 1), policy)
    # the split checkpoint (each rank's experts and their Adam state) exports whole, and one process
    # resumes from it and takes step 3 as the one-process run does
    export_checkpoint(tmp_path / "ep", tmp_path / "ep-export")
    _assert_same_weights(_policy(tmp_path / "ep", 2), load_file(tmp_path / "ep-export" / "model.safetensors"))
    split |= _train(setup, tmp_path / "ep", 3, *moe)
    _assert_same_step(one[3], split[3])


@pytest.mark.slow
def test_experts_split_over_a_tensor_parallel_pair_train_as_one_process(setup, tmp_path, one_moe):
    """actor.tensor_parallel_size=2 with rollout.tensor_parallel_size=2 on the Qwen3-MoE policy: the
    experts split over the TP pair (each rank running all tokens through its own experts), the engine
    likewise: the three steps and weights of one process."""
    moe, one_dir, one = one_moe
    tp = _train(setup, tmp_path / "tp", 3, *moe, *TWO, "actor.tensor_parallel_size=2",
                "rollout.tensor_parallel_size=2")  # fmt: skip
    for step in (1, 2, 3):
        assert tp[step]["router_replay/recorded_fraction"] == 1
        _assert_same_step(one[step], tp[step])
    ones, tps = _policy(one_dir, 3), _policy(tmp_path / "tp", 3)
    assert ones.keys() == tps.keys()
    for name in ones:  # three steps of Adam at lr 1e-2 (each moving weights by ~1e-2) grow the
        # two-rank sums' last bits to 2.4e-4 at most here (the embedding's)
        torch.testing.assert_close(tps[name], ones[name], atol=5e-4, rtol=0, msg=name)
