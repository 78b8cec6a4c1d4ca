"""Resharding the trainer's FSDP2 (x TP) shards into an engine split over TP ranks: bytes each rank
receives and time, point to point (parallel/reshard.py, what a sync runs now) against gathering each
layer whole (the path before it) and against the ideal, in the same run.

    PYTHONPATH=. python bench/reshard.py                       # 4 gloo ranks on this CPU
    PYTHONPATH=. python bench/reshard.py --layouts 2:4,1:2 --layers 4

Received bytes are counted on the wire: every collective and point-to-point receive the sync issues
(a dispatch mode sees the c10d ops: FSDP2's all-gathers, DTensor gathers, sends and receives). The
ideal is the bytes of the engine slices a rank does not hold in its trainer shard (the plan's count;
tests/cpu/test_reshard.py checks it against the elements each rank holds). Ideal time: the busiest
rank's ideal bytes at the point-to-point bandwidth measured in the same run. Prints one JSON object
per layout (actor TP : engine TP)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from hybridflow.controller.worker_group import free_address
from hybridflow.engine import Engine, EngineConfig
from hybridflow.models import tiny_model
from hybridflow.models.native import from_hf_model
from hybridflow.parallel.fsdp import apply_fsdp
from hybridflow.parallel.reshard import ReshardPlan
from hybridflow.parallel.tensor import apply_tensor_parallel


class ReceivedBytes(TorchDispatchMode):
    """Bytes this rank receives through the c10d ops run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("c10d.recv_"):
            self.bytes += sum(t.nbytes for t in args[0])
        elif name.startswith("c10d._allgather_base_"):
            self.bytes += args[0].nbytes - args[1].nbytes
        elif name.startswith("c10d.allgather_"):
            self.bytes += sum(t.nbytes for t in args[0][0]) - args[1][0].nbytes
        elif name.startswith("_c10d_functional.all_gather_into_tensor"):
            self.bytes += args[0].nbytes * (args[1] - 1)
        elif "c10d" in name and not name.startswith(
            ("c10d.send", "_c10d_functional.wait_tensor", "_c10d_functional._wrap")
        ):
            raise RuntimeError(f"uncounted collective {name}")
        return func(*args, **(kwargs or {}))


def _units(names: list[str], layers: int) -> list[list[str]]:
    units = [[n for n in names if n.startswith(f"model.layers.{i}.")] for i in range(layers)]
    return [*units, [n for n in names if not n.startswith("model.layers.")]]


def _gathered_sync(model, engine: Engine, layers: int, *, whole: bool) -> None:
    """The path before: each FSDP unit unsharded; every tensor gathered whole and sliced by the engine
    (`whole`), or, for an engine split like the actor, the unsharded TP parts taken as they are."""
    names = [n for n, _ in model.named_parameters()]
    modules = [*model.model.layers, model]
    for unit, module in zip(_units(names, layers), modules, strict=True):
        module.unshard()
        params = dict(model.named_parameters())
        engine.update_weights([(n, _whole(params[n]) if whole else params[n].detach()) for n in unit])
        module.reshard()


def _whole(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p.detach()


def _timed(fn, repeat: int) -> tuple[float, int]:
    """Median seconds of the slowest rank, and this rank's received bytes of one call."""
    times = []
    for i in range(repeat + 1):
        dist.barrier()
        with ReceivedBytes() as counter:
            start = time.perf_counter()
            fn()
            seconds = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        if i:  # the first call warms up
            times.append(seconds.item())
    return statistics.median(times), counter.bytes


def _bandwidth(world: int, rank: int, megabytes: int = 64) -> float:
    """Bytes/s one rank receives in a pairwise exchange of `megabytes` with its neighbour."""
    out = torch.ones(megabytes * 2**20 // 4)
    into = torch.empty_like(out)
    times = []
    for _ in range(4):
        dist.barrier()
        start = time.perf_counter()
        ops = [
            dist.P2POp(dist.isend, out, (rank + 1) % world),
            dist.P2POp(dist.irecv, into, (rank - 1) % world),
        ]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        seconds = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        times.append(seconds.item())
    return out.nbytes / statistics.median(times[1:])


def _one_layout(
    rank: int, world: int, args, shape: dict, bandwidth: float, actor_tp: int, engine_tp: int
) -> None:
    model = from_hf_model(tiny_model(args.family, seed=0, **shape))
    grid = init_device_mesh("cpu", (world // actor_tp, actor_tp), mesh_dim_names=("dp", "tp"))
    engine_mesh = (  # as worker_models.engine_mesh: the actor's TP groups where the sizes match
        grid
        if actor_tp == engine_tp
        else init_device_mesh("cpu", (world // engine_tp, engine_tp), mesh_dim_names=("rollout_dp", "tp"))
    )
    config = EngineConfig(max_batch_sequences=4, max_context_tokens=64, page_size=16, share_weights=False)
    engine = Engine(model, eos_token_ids=[args.vocab - 1], config=config, tp_mesh=engine_mesh["tp"])
    if actor_tp > 1:
        apply_tensor_parallel(model, grid["tp"])
        apply_fsdp(model, grid["dp"])
    else:
        apply_fsdp(model, init_device_mesh("cpu", (world,)))
    assert isinstance(model, FSDPModule)
    names = [n for n, _ in model.named_parameters()]
    plan = ReshardPlan(dict(model.named_parameters()), engine.weight_tensors(), _units(names, args.layers))

    def resharded():
        for unit in plan.run(dict(model.named_parameters())):
            engine.update_weights(unit)

    p2p_s, p2p_bytes = _timed(resharded, args.repeat)
    before = lambda: _gathered_sync(model, engine, args.layers, whole=actor_tp != engine_tp)  # noqa: E731
    gathered_s, gathered_bytes = _timed(before, args.repeat)
    received = torch.tensor([p2p_bytes, gathered_bytes, plan.received_bytes()], dtype=torch.float64)
    everyone = [torch.empty_like(received) for _ in range(world)]
    dist.all_gather(everyone, received)
    if rank == 0:
        per_rank = torch.stack(everyone)  # [world, 3]
        mib = (per_rank / 2**20).round(decimals=2)
        whole = sum(p.numel() * p.element_size() for p in model.parameters())
        print(json.dumps({
            "layout": f"actor TP {actor_tp} (FSDP2 over {world // actor_tp}) -> engine TP {engine_tp}",
            "model_mib": round(whole / 2**20, 1),
            "received_mib_per_rank": {"point_to_point": mib[:, 0].tolist(), "before": mib[:, 1].tolist(),
                                      "ideal": mib[:, 2].tolist()},
            "seconds": {"point_to_point": round(p2p_s, 4), "before": round(gathered_s, 4),
                        "ideal": round(per_rank[:, 2].max().item() / bandwidth, 4)},
            "p2p_bandwidth_mib_s": round(bandwidth / 2**20),
        }), flush=True)  # fmt: skip


def _rank(rank: int, world: int, port: int, args) -> None:
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    bandwidth = _bandwidth(world, rank)
    shape = dict(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                 num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab)  # fmt: skip
    for layout in args.layouts.split(","):
        _one_layout(rank, world, args, shape, bandwidth, *map(int, layout.split(":")))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--layouts", default="2:4,4:2,1:2,2:2,1:4")
    parser.add_argument("--family", default="qwen2")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    mp.spawn(_rank, args=(args.world, free_address()[1], args), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
