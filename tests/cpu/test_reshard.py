"""Resharding the trainer's FSDP2 (x TP) shards into an engine split over TP ranks, point to point
(hybridflow/parallel/reshard.py), 4 gloo ranks: every weight of the engine equals the trainer's
after a sync (each holding its global element indices, so a misplaced element shows), and each rank
receives exactly the elements of its engine slice that its own trainer shard lacks, counted apart by
the indices each holds. Engine split finer than the actor (TP 2 x 2 -> 4), coarser (4 -> 2), over
FSDP2 alone (dp 4 -> 2) and over the actor's own groups (2 -> 2); dense with a tied head in fp32,
MoE with a bf16 engine (fp32 embedding and norms beside: two dtypes a peer)."""

from dataclasses import replace

import pytest
import torch
import torch.multiprocessing as mp
from gloo_ranks import gloo_group
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from hybridflow.controller.worker_group import free_address
from hybridflow.engine import Engine, EngineConfig
from hybridflow.models import tiny_model
from hybridflow.models.native import from_hf_model
from hybridflow.parallel.fsdp import apply_fsdp
from hybridflow.parallel.reshard import ReshardPlan
from hybridflow.parallel.tensor import apply_tensor_parallel, local_part

WORLD = 4
CONFIG = EngineConfig(max_batch_sequences=4, max_context_tokens=64, page_size=16, share_weights=False)
# the MoE engine computes in bf16 (as on GPUs): its matmul weights travel in bf16, norms and embedding in
# fp32, two buffers a peer
COMPUTE_DTYPE = {"qwen2": "float32", "qwen3_moe": "bfloat16"}


def _indexed(family: str):
    """A tiny model whose every weight holds its elements' flat indices (exact in float32)."""
    model = from_hf_model(tiny_model(family, seed=0, num_attention_heads=8, num_key_value_heads=4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).view(p.shape))
    return model


def _rank(rank: int, world: int, port: int) -> None:
    with gloo_group(rank, world, port):
        for family in ("qwen2", "qwen3_moe"):
            for actor_tp, engine_tp in ((2, 4), (4, 2), (1, 2), (2, 2)):
                _resharded_engine_equals_the_trainer(family, actor_tp, engine_tp)


def _resharded_engine_equals_the_trainer(family: str, actor_tp: int, engine_tp: int) -> None:
    what = f"{family}, actor TP {actor_tp} -> engine TP {engine_tp}"
    model = _indexed(family)
    whole = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine_mesh = init_device_mesh(
        "cpu", (WORLD // engine_tp, engine_tp), mesh_dim_names=("rollout_dp", "tp")
    )
    engine = Engine(
        model,
        eos_token_ids=[model.config.vocab_size - 1],
        config=replace(CONFIG, compute_dtype=COMPUTE_DTYPE[family]),
        tp_mesh=engine_mesh["tp"],
    )
    if actor_tp > 1:
        grid = init_device_mesh("cpu", (WORLD // actor_tp, actor_tp), mesh_dim_names=("dp", "tp"))
        apply_tensor_parallel(model, grid["tp"])
        apply_fsdp(model, grid["dp"])
    else:
        apply_fsdp(model, init_device_mesh("cpu", (WORLD,)))
    targets = engine.weight_tensors()
    with torch.no_grad():
        for t in targets.values():
            (t.to_local() if isinstance(t, DTensor) else t).zero_()
    sources = dict(model.named_parameters())
    names = list(sources)
    units = [
        [n for n in names if n.startswith(f"model.layers.{i}.")]
        for i in range(model.config.num_hidden_layers)
    ]
    units.append([n for n in names if not n.startswith("model.layers.")])
    plan = ReshardPlan(sources, targets, units)
    for unit in plan.run(sources):
        engine.update_weights(unit)
    ideal = 0
    for name, target in targets.items():
        expected = local_part(whole[name], target) if isinstance(target, DTensor) else whole[name]
        got = target.to_local() if isinstance(target, DTensor) else target
        assert torch.equal(got, expected.to(got.dtype)), f"{what}: {name}"
        held = sources[name].to_local().reshape(-1)
        ideal += expected.numel() - int(torch.isin(expected.reshape(-1), held).sum())
    assert plan.received_elements() == ideal, f"{what}: {plan.received_elements()} received, ideal {ideal}"


@pytest.mark.slow
def test_an_engine_split_over_tp_ranks_receives_only_what_its_slices_lack():
    mp.spawn(_rank, args=(WORLD, free_address()[1]), nprocs=WORLD, join=True)
