"""Expert parallelism (hybridflow/parallel/expert.py) over gloo: each rank keeps its share of every MoE
layer's experts, FSDP2 shards the rest, every rank trains on its own sequences; the log-probs of each
rank's tokens and every parameter's gradient equal one process's on all the sequences (FSDP2's mean
over ranks: half the one-process sum on two). Qwen3-MoE (a dense first layer, renormalised top-k) and
Mixtral; 2 ranks with 2 experts each, and 4 ranks in two groups of 2; then with every token replayed
to experts 0 and 1 (router replay), so that some ranks' experts receive no row at all and their backward
must still take part in the exchanges (it hung before)."""

import copy

import pytest
import torch
import torch.multiprocessing as mp
from gloo_ranks import gloo_group
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.testing import assert_close

from hybridflow.batch import pack_sequences
from hybridflow.controller.worker_group import free_address
from hybridflow.errors import UserError
from hybridflow.models import tiny_model
from hybridflow.models.native import chunked_token_logprobs, from_hf_model
from hybridflow.parallel.expert import (
    apply_expert_parallel,
    expert_parallel_parameters,
    reduce_expert_gradients,
)
from hybridflow.parallel.fsdp import apply_fsdp

SEQS = [
    [5, 9, 200, 17, 3, 8, 77, 258],
    [44, 2, 2, 90],
    list(range(30, 52)),
    [7, 7, 7],
    [100, 101, 102, 103, 9],
]


def _logprobs_and_backward(model, seqs, targets, weights, replay):
    packed = pack_sequences(seqs)
    n, layers = len(packed.input_ids), len(model.config.moe.sparse_layers)
    routes = torch.tensor([0, 1]).expand(n, layers, 2) if replay else None  # [N, L_moe, k]
    hidden = model.hidden_states(packed.input_ids, packed.position_ids, packed.cu_seqlens, routes=routes)
    logp, _ = chunked_token_logprobs(hidden, model.lm_head.weight, targets, chunk=7)
    (logp * weights).sum().backward()
    return logp.detach()


def _rank(rank: int, world: int, port: int, families: list[str], ep: int) -> None:
    # a rank left out of an exchange fails the test in a minute instead of hanging it
    with gloo_group(rank, world, port, timeout_s=60):
        for family in families:  # one process group for all: each start costs seconds
            for replay in (False, True):
                _expert_parallel_equals_one_process(rank, world, family, replay, ep)


def _expert_parallel_equals_one_process(rank: int, world: int, family: str, replay: bool, ep: int) -> None:
    single = from_hf_model(tiny_model(family, seed=3)).train()
    sharded = copy.deepcopy(single)
    every = torch.tensor([t for seq in SEQS for t in seq])
    targets, weights = torch.roll(every, -1), torch.linspace(-1.0, 2.0, len(every))
    logp = _logprobs_and_backward(single, SEQS, targets, weights, replay)

    mesh = init_device_mesh("cpu", (world,))
    apply_expert_parallel(sharded, mesh, ep)
    apply_fsdp(sharded, mesh)
    experts = sharded.model.layers[1].mlp.experts
    assert experts.gate_up_proj.to_local().shape[0] == 4 // ep  # only this rank's experts
    assert len(expert_parallel_parameters(sharded)) == 2 * len(sharded.config.moe.sparse_layers)
    mine = SEQS[rank::world]  # this rank's sequences; where its tokens sit among one process's
    starts = torch.tensor([0, *map(len, SEQS)]).cumsum(0)
    rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in range(rank, len(SEQS), world)])
    assert_close(
        _logprobs_and_backward(sharded, mine, targets[rows], weights[rows], replay),
        logp[rows],
        atol=2e-5,
        rtol=1e-5,
    )
    reduce_expert_gradients(sharded)  # groups of ep ranks: summed across them (as the optimizer step does)
    theirs = dict(single.named_parameters())
    for name, p in sharded.named_parameters():
        assert isinstance(p.grad, DTensor), name
        assert_close(
            p.grad.full_tensor(), theirs[name].grad / world, atol=2e-5, rtol=1e-4, msg=f"{family} {name}"
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    "world, ep, families",
    [
        (2, 2, ["qwen3_moe", "mixtral"]),  # one group: every rank's experts its own
        (4, 2, ["qwen3_moe"]),  # two groups of two: each expert on two ranks, gradients summed across
    ],
)
def test_expert_parallel_over_fsdp_equals_one_process(world, ep, families):
    mp.spawn(_rank, args=(world, free_address()[1], families, ep), nprocs=world, join=True)


def test_expert_parallel_needs_experts_it_can_split():
    class Ranks:
        def __init__(self, n):
            self.n = n

        def size(self):
            return self.n

    with pytest.raises(UserError, match="needs a mixture-of-experts model; this one is dense"):
        apply_expert_parallel(from_hf_model(tiny_model("qwen3", seed=3)), Ranks(2))
    with pytest.raises(UserError, match="expert parallel size 3 does not divide the model's num_experts=4"):
        apply_expert_parallel(from_hf_model(tiny_model("qwen3_moe", seed=3)), Ranks(3))


def test_expert_parallel_sizes_that_cannot_run_are_refused_in_one_line(setup, tmp_path):
    from rl_run import config

    from hybridflow.controller.trainer import RLTrainer
    from hybridflow.models import byte_tokenizer, save_hf

    with pytest.raises(
        UserError, match="actor.expert_parallel_size=2 splits the experts of our native mixture"
    ):
        RLTrainer(config(setup, tmp_path / "dense", "actor.expert_parallel_size=2"))
    save_hf(tiny_model("qwen3_moe", seed=0), byte_tokenizer(), tmp_path / "moe")
    with pytest.raises(UserError, match="needs a multiple of 2 training workers .*, not 1"):
        RLTrainer(
            config(setup, tmp_path / "one", f"model.path={tmp_path / 'moe'}", "actor.expert_parallel_size=2")
        )
