"""The Ray worker group on CPU: two workers in one gloo process group, batches split by rank and
gathered back in order, worker errors surfacing with rank and traceback."""

import os
import sys

import pytest
import torch

ray = pytest.importorskip("ray")
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need this module's classes

from local_ray import start_local_ray  # noqa: E402

from hybridflow.controller.ray_worker_group import RayWorkerGroup, WorkerError  # noqa: E402


class Rows(list):
    def select(self, rows):
        return Rows(self[i] for i in rows)


class Role:
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def rank_sum(self) -> float:
        t = torch.tensor([float(self.rank + 1)])
        torch.distributed.all_reduce(t)  # across the workers' gloo group
        return t.item()

    def squares(self, shard: Rows) -> torch.Tensor:
        return torch.tensor([float(x * x) for x in shard])

    def shard_sizes(self, shard: Rows) -> int:
        return len(shard)

    def die_on_rank_one(self) -> int:
        if self.rank == 1:
            os._exit(1)  # the worker process disappears
        return self.rank

    def fail_on_rank_one_while_rank_zero_waits(self) -> float:
        if self.rank == 1:
            raise ValueError("rank 1 fails before the collective")
        t = torch.ones(1)
        torch.distributed.all_reduce(t)  # rank 1 never arrives: rank 0 waits here for good
        return t.item()

    def sleep(self, seconds: float) -> int:
        import time

        time.sleep(seconds)
        return self.rank

    def fail_on_rank_one(self) -> int:
        if self.rank == 1:
            raise ValueError("a bad row, on purpose")
        return self.rank


@pytest.fixture(scope="module")
def group():
    ray.shutdown()  # a test run alone may have started Ray with this machine's own CPU count
    start_local_ray()
    g = RayWorkerGroup(Role, num_workers=2, timeout_s=300)
    yield g
    g.shutdown()
    ray.shutdown()


@pytest.mark.slow
def test_workers_form_one_process_group(group):
    assert group.call("rank_sum") == [3.0, 3.0]  # 1 + 2 on both ranks
    # a Ray instance started here runs its workers level with this process (Ray's own default is 15)
    assert group.niceness == os.nice(0)


@pytest.mark.slow
def test_split_balances_by_length_and_gathers_in_order(group):
    batch = Rows(range(10))
    lengths = [4000, 10, 10, 10, 10, 10, 10, 10, 10, 3000]
    assert torch.equal(
        group.call_split("squares", batch, lengths), torch.tensor([float(i * i) for i in range(10)])
    )
    sizes = group.call_split("shard_sizes", batch, lengths)
    # work = L + L^2/4096: the 4000-token row (7,906) alone; the 3000-token row (5,197) and the eight
    # short ones together still weigh less
    assert sorted(sizes) == [1, 9]


@pytest.mark.slow
def test_worker_error_names_rank_and_traceback(group):
    with pytest.raises(WorkerError) as err:
        group.call("fail_on_rank_one")
    message = str(err.value)
    assert "worker rank 1 raised" in message and "ValueError: a bad row, on purpose" in message
    assert "fail_on_rank_one" in message  # the worker's traceback


@pytest.mark.slow
def test_an_error_surfaces_while_its_peer_waits_in_a_collective_and_slow_calls_time_out():
    """Rank 1 raises before an all-reduce that rank 0 is blocked in: the controller reports rank 1's
    traceback at once instead of waiting on rank 0 for ever. A call past timeout_s names its ranks, and
    the stuck workers' stacks are in their logs (written on a signal: they answer no actor call). A
    group whose last call failed shuts down without waiting for ranks that will never get there."""
    import time

    group = RayWorkerGroup(Role, num_workers=2, timeout_s=120)
    try:
        start = time.monotonic()
        with pytest.raises(
            WorkerError, match="worker rank 1 raised(.|\\n)*rank 1 fails before the collective"
        ):
            group.call("fail_on_rank_one_while_rank_zero_waits")
        assert time.monotonic() - start < 60  # well before the timeout, even on a loaded machine
    finally:
        start = time.monotonic()
        group.shutdown()  # rank 0 is still in the all-reduce
        assert time.monotonic() - start < 5  # no 10 s grace period for it
    group = RayWorkerGroup(SlowToBuildRole, num_workers=2, timeout_s=3)  # its start is not a call
    try:
        with pytest.raises(WorkerError, match=r"worker ranks \[0, 1\] did not finish within 3 s"):
            group.call("sleep", 30)
        for _, pid in group.locations:
            assert _stack_in_log(pid, "in sleep"), f"no stack of worker {pid} in its log"
    finally:
        group.shutdown()


class SlowToBuildRole(Role):
    """Builds for longer than its group's 3 s call bound, as a role loading a model on a busy machine."""

    def __init__(self, rank: int, world_size: int) -> None:
        import time

        time.sleep(4)
        super().__init__(rank, world_size)


class RoleFailingToBuild(Role):
    def __init__(self, rank: int, world_size: int) -> None:
        if rank == 1:
            raise ValueError("rank 1 cannot build its role")
        super().__init__(rank, world_size)


def _stack_in_log(pid: int, text: str, deadline_s: float = 20) -> bool:
    """`text` in the stderr log Ray keeps of worker process `pid` (this session's), within the deadline."""
    import glob
    import time

    logs = ray._private.worker.global_worker.node.get_logs_dir_path()
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        for path in glob.glob(os.path.join(logs, f"worker-*-{pid}.err")):
            with open(path, errors="replace") as f:
                if text in f.read():
                    return True
        time.sleep(0.2)
    return False


class FSDPRole:
    """A tiny native model sharded with FSDP2 over the workers' gloo group."""

    def __init__(self, rank: int, world_size: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        from hybridflow.models import tiny_model
        from hybridflow.models.native import from_hf_model
        from hybridflow.parallel import apply_fsdp

        self.model = apply_fsdp(
            from_hf_model(tiny_model("qwen2", seed=3)).train(), init_device_mesh("cpu", (world_size,))
        )

    def gradients(self, shard: Rows, global_tokens: int) -> dict:
        return _loss_gradients(self.model, shard, global_tokens)


def _loss_gradients(model, sequences, global_tokens: int) -> dict:
    """-(sum of next-token log-probs) / global token count, backward; full gradients by name."""
    from hybridflow.models.native import sequence_log_probs
    from hybridflow.parallel import data_parallel_scale

    model.zero_grad()
    loss = -sum(lp.sum() for lp in sequence_log_probs(model, list(sequences))) / global_tokens
    (loss * data_parallel_scale()).backward()
    return {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
        for n, p in model.named_parameters()
    }


@pytest.mark.slow
def test_fsdp_over_two_workers_gives_the_single_process_gradients(group):
    from hybridflow.models import tiny_model
    from hybridflow.models.native import from_hf_model

    sequences = Rows([[5, 9, 200, 17, 3, 8], [44, 2, 2], list(range(30, 70)), [7, 7, 8, 9, 250, 1, 2]])
    tokens = sum(len(s) - 1 for s in sequences)
    fsdp = RayWorkerGroup(FSDPRole, num_workers=2, timeout_s=300)
    try:
        per_rank = fsdp.call_split("gradients", sequences, [len(s) for s in sequences], global_tokens=tokens)
    finally:
        fsdp.shutdown()
    reference = _loss_gradients(from_hf_model(tiny_model("qwen2", seed=3)).train(), sequences, tokens)
    for grads in per_rank:  # every rank holds the same full gradient
        for name, g in reference.items():
            torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-5, msg=name)


class SequenceParallelRole(FSDPRole):
    """FSDP2 and Ulysses over both workers: one sequence-parallel group, each rank given the same
    sequences and keeping half of their tokens."""

    def __init__(self, rank: int, world_size: int) -> None:
        from hybridflow.parallel.ulysses import apply_sequence_parallel, init_sequence_parallel

        super().__init__(rank, world_size)
        apply_sequence_parallel(self.model, init_sequence_parallel(world_size))

    def hidden_states(self, sequences: Rows) -> torch.Tensor:
        from hybridflow.batch import pack_sequences

        packed = pack_sequences(list(sequences))
        with torch.no_grad():
            return self.model.hidden_states(packed.input_ids, packed.position_ids, packed.cu_seqlens)


@pytest.mark.slow
def test_ulysses_over_two_workers_equals_one_process(group):
    from hybridflow.batch import pack_sequences
    from hybridflow.models import tiny_model
    from hybridflow.models.native import from_hf_model

    # 57 tokens: the packed stream is padded to split evenly; 4 query heads, 2 KV heads split 2 ways
    sequences = Rows([[5, 9, 200, 17, 3, 8], [44, 2, 2], list(range(30, 71)), [7, 7, 8, 9, 250, 1, 2]])
    tokens = sum(len(s) - 1 for s in sequences)
    sp = RayWorkerGroup(SequenceParallelRole, num_workers=2, timeout_s=300)
    try:
        hidden = sp.call("hidden_states", sequences)
        per_rank = sp.call("gradients", sequences, global_tokens=tokens)
    finally:
        sp.shutdown()
    model = from_hf_model(tiny_model("qwen2", seed=3))
    packed = pack_sequences(list(sequences))
    with torch.no_grad():
        expected = model.hidden_states(packed.input_ids, packed.position_ids, packed.cu_seqlens)
    for h in hidden:  # every rank of the group holds all 57 positions
        torch.testing.assert_close(h, expected, atol=1e-5, rtol=1e-5)
    reference = _loss_gradients(model.train(), sequences, tokens)
    for grads in per_rank:
        for name, g in reference.items():
            torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-5, msg=name)


class TrainerRole(FSDPRole):
    """One AdamW step of the sharded model, sharded checkpoints, and full weights for comparison."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def step(self, shard: Rows, global_tokens: int) -> None:
        _loss_gradients(self.model, shard, global_tokens)
        self.optimizer.step()

    def save(self, path: str) -> None:
        from hybridflow.parallel.checkpoint import save_sharded

        save_sharded(self.model, self.optimizer, path)

    def load(self, path: str) -> None:
        from hybridflow.parallel.checkpoint import load_sharded

        load_sharded(self.model, self.optimizer, path)

    def full_weights(self) -> dict:
        return {n: p.full_tensor().clone() for n, p in self.model.named_parameters()}


@pytest.mark.slow
def test_sharded_checkpoint_saved_on_two_ranks_resumes_in_one_and_back(tmp_path):
    from hybridflow.models import tiny_model
    from hybridflow.models.native import from_hf_model
    from hybridflow.parallel.checkpoint import load_sharded, save_sharded

    sequences = Rows([[5, 9, 200, 17, 3, 8], [44, 2, 2], list(range(30, 70)), [7, 7, 8, 9, 250, 1, 2]])
    tokens, lengths = sum(len(s) - 1 for s in sequences), [len(s) for s in sequences]
    two = RayWorkerGroup(TrainerRole, num_workers=2, timeout_s=300)
    try:
        two.call_split("step", sequences, lengths, global_tokens=tokens)
        two.call("save", str(tmp_path / "two"))
        trained = two.call("full_weights")[0]
        # one process: load the 2-rank checkpoint, take a second step, save
        single = from_hf_model(tiny_model("qwen2", seed=3)).train()
        optimizer = torch.optim.AdamW(single.parameters(), lr=1e-2)
        _loss_gradients(single, sequences, tokens)
        optimizer.step()  # creates the optimizer state that the load fills
        load_sharded(single, optimizer, tmp_path / "two")
        for name, p in single.named_parameters():
            torch.testing.assert_close(p.detach(), trained[name], atol=0, rtol=0, msg=name)
        _loss_gradients(single, sequences, tokens)
        optimizer.step()
        save_sharded(single, optimizer, tmp_path / "one")
        # back on two ranks: the second step taken in one process, loaded from its checkpoint
        two.call("load", str(tmp_path / "one"))
        resumed = two.call("full_weights")[0]
    finally:
        two.shutdown()
    for name, p in single.named_parameters():
        torch.testing.assert_close(resumed[name], p.detach(), atol=0, rtol=0, msg=name)


def _actor(model):
    from hybridflow.config.schema import ActorConfig
    from hybridflow.roles.actor import Actor

    config = ActorConfig(max_tokens_per_microbatch=16, use_kl_loss=False, compute_dtype="float32")
    config.optim.lr = 1e-2
    return Actor(model, config, total_steps=1, max_response_tokens=8, pad_token_id=0)


def _policy_batch():
    from hybridflow.batch import TrainingBatch, pad_ragged

    prompts = [[5, 9, 200, 17], [44, 2], list(range(30, 60)), [7, 7, 8], [11, 12, 13, 14, 15], [3]]
    responses = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11], [12], [13, 14], [15, 16, 17, 18], [19, 20, 21]]
    mask = pad_ragged([[1.0] * len(r) for r in responses])
    advantages = torch.tensor([1.0, -0.5, 2.0, -1.0, 0.25, 0.75])[:, None] * mask
    return TrainingBatch(prompts, responses, mask, advantages=advantages)


class ActorRole:
    """The Actor role over an FSDP2-sharded policy: one PPO update on this rank's share."""

    def __init__(self, rank: int, world_size: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        from hybridflow.models import tiny_model
        from hybridflow.models.native import from_hf_model
        from hybridflow.parallel import apply_fsdp

        model = from_hf_model(tiny_model("qwen2", seed=3))
        self.actor = _actor(apply_fsdp(model, init_device_mesh("cpu", (world_size,))))

    def update(self, shard) -> dict:
        return self.actor.update(shard)

    def full_weights(self) -> dict:
        return {n: p.full_tensor().clone() for n, p in self.actor.model.named_parameters()}


@pytest.mark.slow
def test_actor_update_on_two_ranks_equals_one_process():
    """The same PPO update, split over two FSDP2 ranks (uneven shards, different micro-batch counts)
    and in one process: same metrics and the same updated weights (fp32 tolerance)."""
    from hybridflow.batch import balance_partitions, plan_microbatches
    from hybridflow.models import tiny_model
    from hybridflow.models.native import from_hf_model

    batch = _policy_batch()
    lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    shards = balance_partitions(lengths, 2)
    counts = [len(plan_microbatches([lengths[i] for i in rows], 16)) for rows in shards]
    assert counts[0] != counts[1]  # one rank runs padding micro-batches to keep FSDP in step
    two = RayWorkerGroup(ActorRole, num_workers=2, timeout_s=300)
    try:
        metrics = two.call_split("update", batch, lengths)
        weights = two.call("full_weights")[0]
    finally:
        two.shutdown()
    single = _actor(from_hf_model(tiny_model("qwen2", seed=3)))
    expected = single.update(batch)
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac"):
        assert metrics[0][key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
        assert metrics[1][key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
    for name, p in single.model.named_parameters():
        # Adam divides by sqrt(v): on near-zero gradients the last-bit differences of a two-rank sum
        # grow to ~1e-5 of a weight; that is 0.1% of this step (lr 1e-2)
        torch.testing.assert_close(weights[name], p.detach(), atol=2e-5, rtol=0, msg=name)


@pytest.mark.slow
def test_workers_that_cannot_be_placed_stop_with_a_message(group):
    # the fixture's group holds 2 of the cluster's 4 CPU slots: 3 more cannot be placed
    with pytest.raises(WorkerError, match="could not place 3 workers with one CPU each within 5 s"):
        RayWorkerGroup(Role, num_workers=3, timeout_s=5, start_timeout_s=5)
    assert group.call("shard_sizes", Rows([1])) == [1, 1]  # the group in place is untouched


@pytest.mark.slow
def test_a_group_that_fails_to_start_gives_its_slots_back(group):
    # the fixture's group holds 2 of the cluster's 4 CPU slots; a start that fails must free the 2 it took
    with pytest.raises(WorkerError, match="worker rank 1 raised(.|\\n)*rank 1 cannot build its role"):
        RayWorkerGroup(RoleFailingToBuild, num_workers=2, timeout_s=300)
    again = RayWorkerGroup(Role, num_workers=2, timeout_s=300, start_timeout_s=60)
    try:
        assert again.call("shard_sizes", Rows([1])) == [1, 1]
    finally:
        again.shutdown()
    assert group.call("shard_sizes", Rows([1])) == [1, 1]


@pytest.mark.slow
def test_a_dead_worker_stops_the_run_with_its_rank(group):  # last: it breaks the group
    with pytest.raises(WorkerError, match="worker rank 1 died .*resume from the last checkpoint"):
        group.call("die_on_rank_one")
