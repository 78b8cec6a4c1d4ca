"""Tensor parallelism of the native model (hybridflow/parallel/tensor.py) over gloo, 2 and 4 ranks:
logits, log-probs and entropy (vocabulary-parallel, never gathered) and every parameter's gradient
equal one process's with four all-reduces a dense layer, for families with q/k/v biases, q/k norms,
tied and untied heads, mixture-of-experts layers (experts split over the ranks), and a vocabulary
(259) that does not split evenly."""

import copy

import pytest
import torch
import torch.multiprocessing as mp
from gloo_ranks import gloo_group
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing import assert_close

from hybridflow.algorithms.losses import entropy_from_logits
from hybridflow.batch import pack_sequences
from hybridflow.controller.worker_group import free_address
from hybridflow.errors import UserError
from hybridflow.models import tiny_model
from hybridflow.models.native import chunked_token_logprobs, from_hf_model
from hybridflow.parallel.fsdp import apply_fsdp
from hybridflow.parallel.tensor import apply_tensor_parallel, full_logits, vocab_parallel_logprobs

SEQS = [[5, 9, 200, 17, 3, 8, 77, 258], [44, 2, 2, 90], list(range(30, 52))]


def _step(model, packed, logprobs):
    """Log-probs of each next token, entropy, and the backward of a loss of both (weights differ per
    token, as an entropy bonus with per-token advantages would)."""
    hidden = model.hidden_states(packed.input_ids, packed.position_ids, packed.cu_seqlens)
    targets = torch.roll(packed.input_ids, -1)
    logp, entropy = logprobs(hidden, targets)
    weights = torch.linspace(-1.0, 2.0, logp.numel())
    ((logp * weights).sum() + (entropy * weights.flip(0)).sum()).backward()
    return hidden, logp.detach(), entropy.detach()


def _one_process(model):
    """Log-probs chunked, the entropy from the full logits (the path that carries its gradient)."""
    return lambda h, t: (
        chunked_token_logprobs(h, model.lm_head.weight, t, chunk=7)[0],
        entropy_from_logits(model.lm_head(h)),
    )


def _rank(rank: int, world: int, port: int, cases: list[tuple[str, dict]]) -> None:
    with gloo_group(rank, world, port):
        for family, overrides in cases:  # one process group for all: each start costs seconds
            _tensor_parallel_equals_one_process(rank, world, family, overrides)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _tensor_parallel_equals_one_process(rank: int, world: int, family: str, overrides: dict) -> None:
    single = from_hf_model(tiny_model(family, seed=3, **overrides)).train()
    sharded = copy.deepcopy(single)
    packed = pack_sequences(SEQS)
    _, logp, entropy = _step(single, packed, _one_process(single))
    apply_tensor_parallel(sharded, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    head = sharded.lm_head.weight
    rows = torch.arange(single.config.vocab_size).chunk(world)[rank]  # 130 and 129 of 259 on 2 ranks
    assert isinstance(head, DTensor) and head.to_local().shape[0] == len(rows)
    comms = CommDebugMode()
    with comms:
        hidden, tp_logp, tp_entropy = _step(
            sharded, packed, lambda h, t: vocab_parallel_logprobs(h, sharded.lm_head.weight, t, chunk=7)
        )
    if single.config.moe is None:
        # the layers' all-reduces: o and down in the forward, and in the backward one per group of
        # column-parallel projections (q/k/v, gate/up: their input gradients summed at their norm),
        # not one per projection; plus the embedding's (the head's log-probs reduce apart, by c10d)
        reduces = comms.get_comm_counts()[torch.ops.c10d_functional.all_reduce]
        assert reduces == 4 * single.config.num_hidden_layers + 1, family
    assert_close(tp_logp, logp, atol=2e-5, rtol=1e-5, msg=family)
    assert_close(tp_entropy, entropy, atol=2e-5, rtol=1e-5, msg=family)
    with torch.no_grad():
        assert_close(full_logits(sharded, hidden), single.lm_head(hidden), atol=2e-5, rtol=1e-5, msg=family)
    theirs = dict(single.named_parameters())
    for name, p in sharded.named_parameters():
        assert_close(_whole(p.grad), theirs[name].grad, atol=2e-5, rtol=1e-4, msg=f"{family} {name}")
    # with activation checkpointing the layers' forward runs again in the backward, the plan's hooks
    # with it: the same gradients (a tied embedding's two parts add in another order: ~1e-6 apart)
    first = {name: _whole(p.grad) for name, p in sharded.named_parameters()}
    sharded.zero_grad(set_to_none=True)
    sharded.gradient_checkpointing = True
    _step(sharded, packed, lambda h, t: vocab_parallel_logprobs(h, sharded.lm_head.weight, t, chunk=7))
    for name, p in sharded.named_parameters():
        assert_close(_whole(p.grad), first[name], atol=2e-6, rtol=1e-5, msg=f"{family} {name} checkpointed")


@pytest.mark.slow
@pytest.mark.parametrize(
    "world, cases",
    [
        # q/k/v biases and a tied head; Qwen3's q/k norms; an untied head; experts split over the ranks
        # (Qwen3-MoE with a dense first layer; Mixtral); one expert a rank
        (2, [("qwen2", {}), ("qwen3", {}), ("llama3", {}), ("qwen3_moe", {}), ("mixtral", {})]),
        (4, [("qwen2", {"num_key_value_heads": 4}), ("qwen3_moe", {"num_key_value_heads": 4})]),
    ],
)
def test_tensor_parallel_equals_one_process(world, cases):
    mp.spawn(_rank, args=(world, free_address()[1], cases), nprocs=world, join=True)


def _fsdp_tp_rank(rank: int, world: int, port: int) -> None:
    """2 data-parallel x 2 tensor-parallel ranks: each data-parallel pair trains on half the
    sequences; FSDP2 averages over the pairs, so the gradients are half the one-process sum's. A
    dense family, and an MoE one (its experts split over each pair, then sharded by FSDP2)."""
    with gloo_group(rank, world, port):
        for family, replay in (("qwen3", False), ("qwen3_moe", False), ("qwen3_moe", True)):
            _fsdp_tp_equals_one_process(family, replay)


def _fsdp_tp_equals_one_process(family: str, replay: bool) -> None:
    """`replay`: every token routed to experts 0 and 1 (router replay), so the second rank of each
    tensor-parallel pair gets no row: its backward must still join the pair's all-reduces."""
    single = from_hf_model(tiny_model(family, seed=3)).train()
    sharded = copy.deepcopy(single)
    n = sum(map(len, SEQS))
    routes = torch.tensor([0, 1]).expand(n, len(single.config.moe.sparse_layers), 2) if replay else None
    whole = pack_sequences(SEQS)
    hidden = single.hidden_states(whole.input_ids, whole.position_ids, whole.cu_seqlens, routes=routes)
    targets = torch.roll(whole.input_ids, -1)
    logp, _ = chunked_token_logprobs(hidden, single.lm_head.weight, targets, chunk=7)
    (logp * torch.linspace(-1.0, 2.0, n)).sum().backward()  # as _step weights the tokens
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    apply_tensor_parallel(sharded, mesh["tp"])
    apply_fsdp(sharded, mesh["dp"])
    pair = mesh["dp"].get_local_rank()
    mine = [SEQS[:2], SEQS[2:]][pair]  # this pair's sequences
    packed = pack_sequences(mine)
    offset = 0 if pair == 0 else sum(map(len, SEQS[:2]))  # where its tokens sit in one process's
    every = torch.tensor([t for seq in SEQS for t in seq])
    targets = torch.roll(every, -1)[offset : offset + len(packed.input_ids)]  # one process's targets
    weights = torch.linspace(-1.0, 2.0, len(every))[offset : offset + len(packed.input_ids)]
    mine_routes = routes[offset : offset + len(packed.input_ids)] if replay else None
    hidden = sharded.hidden_states(
        packed.input_ids, packed.position_ids, packed.cu_seqlens, routes=mine_routes
    )
    logp, _ = vocab_parallel_logprobs(hidden, sharded.lm_head.weight, targets, chunk=7)
    (logp * weights).sum().backward()
    theirs = dict(single.named_parameters())
    for name, p in sharded.named_parameters():
        assert p.grad is not None, f"{family} {name}: no gradient"
        assert_close(
            p.grad.full_tensor(), theirs[name].grad / 2, atol=2e-5, rtol=1e-4, msg=f"{family} {name} {replay}"
        )


@pytest.mark.slow
def test_fsdp_over_tensor_parallel_pairs_equals_one_process():
    mp.spawn(_fsdp_tp_rank, args=(4, free_address()[1]), nprocs=4, join=True)


def test_sizes_tensor_parallelism_cannot_split_are_named():
    model = from_hf_model(tiny_model("qwen2", seed=3))  # 2 KV heads

    class FourRanks:
        mesh_dim_names = ("tp",)

        def size(self):
            return 4

    with pytest.raises(UserError, match="does not divide the model's num_key_value_heads=2"):
        apply_tensor_parallel(model, FourRanks())


def test_a_tensor_parallel_size_one_process_cannot_hold_is_refused(setup, tmp_path):
    from rl_run import config

    from hybridflow.controller.trainer import RLTrainer

    with pytest.raises(
        UserError, match="actor.tensor_parallel_size=2 needs a multiple of 2 training workers"
    ):
        RLTrainer(config(setup, tmp_path / "run", "actor.tensor_parallel_size=2"))
