"""A rollout worker of a disaggregated placement: a GPU (or CPU slot) that holds only the rollout
engine, with a full copy of the policy (or its slices of an engine split over workers), and receives
the actor's weights after each update (a broadcast; its slices alone, when split) instead of sharing a
GPU with the trainer."""

from __future__ import annotations

from pathlib import Path

import torch

from hybridflow.agents.setup import agent_loop
from hybridflow.batch import Prompt, Rollouts
from hybridflow.config.schema import Config
from hybridflow.controller.role_models import policy_model, rollout_backend
from hybridflow.controller.worker_models import engine_mesh
from hybridflow.devices import DTYPES, resolve_device, seed_process
from hybridflow.models.loading import load_model
from hybridflow.parallel.reshard import Box, box_shape, held_box, placed
from hybridflow.parallel.weight_sync import WeightSync, unpack
from hybridflow.rewards.hidden import hidden_paths
from hybridflow.roles.rollout import Rollout
from hybridflow.rollout.sampling import SamplingParams
from hybridflow.stream.host import StreamHost


class RolloutWorker:
    """Built by a worker group as `RolloutWorker(config, rank, world_size)`."""

    def __init__(self, config: Config, rank: int, world_size: int) -> None:
        c = self.config = config
        self.rank = rank
        self.device = resolve_device(c.resources.device)
        seed_process(c.trainer.seed, deterministic=c.deterministic_processes)
        hf_model, tokenizer = load_model(c.model)
        policy = policy_model(c, hf_model).to(self.device)  # the engine copies it (the actor's start)
        if c.rollout.backend == "hf":
            hf_model.to(self.device)
        # rollout.tensor_parallel_size: consecutive rollout workers split one engine (the actor's rank 0
        # sends each its slices of every layer)
        backend = rollout_backend(
            c, hf_model, policy, tokenizer, self.device, Path(c.trainer.run_dir), share_weights=False,
            tp_mesh=engine_mesh(c, world_size, self.device),
        )  # fmt: skip
        del hf_model, policy
        if hasattr(backend, "resize_pool"):
            backend.resize_pool()  # the policy it was copied from is gone: room for more KV
        self.rollout = Rollout(
            backend, agent_loop(c.rollout.agent, tokenizer, c.data.max_response_tokens, hidden_paths(c))
        )
        self.stream_host = StreamHost(backend, self.rollout.agent)
        self.weight_sync: WeightSync | None = None
        self.peak = 0.0

    def join_weight_sync(self, master: tuple[str, int], sync_rank: int, sync_size: int) -> None:
        self.weight_sync = WeightSync(master, sync_rank, sync_size, self.device)

    def weight_slices(self) -> dict[str, Box] | None:
        """This worker's box of each of the engine's weights (by the trainer's names) when the engine is
        split over rollout workers, else None (whole layers are broadcast)."""
        if self.config.rollout.tensor_parallel_size == 1 or not hasattr(
            self.rollout.backend, "weight_tensors"
        ):
            return None
        return {name: held_box(t) for name, t in self.rollout.backend.weight_tensors().items()}

    def generate(self, prompts: list[Prompt], params: SamplingParams, first_group: int = 0) -> Rollouts:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        out = self.rollout.generate(prompts, params, first_group=first_group)
        if self.device.type == "cuda":
            self.peak = max(self.peak, torch.cuda.max_memory_allocated(self.device) / 2**30)
        return out

    @torch.no_grad()
    def receive_weights(
        self, units: list[list[tuple[str, tuple[int, ...]]]], dtype: str, apply: bool = True
    ) -> None:
        """The actor's weights, one broadcast per unit of (name, shape) pairs, into the engine; an engine
        split over rollout workers receives its slices only (`apply=False`: received and dropped, a
        worker that holds them already while a replaced one catches up)."""
        slices = self.weight_slices()
        targets = self.rollout.backend.weight_tensors() if slices is not None else {}
        for unit in units:
            names = [n for n, _ in unit]
            shapes = [s for _, s in unit] if slices is None else [box_shape(slices[n]) for n in names]
            flat = torch.empty(
                sum(torch.Size(s).numel() for s in shapes), dtype=DTYPES[dtype], device=self.device
            )
            if slices is None:
                self.weight_sync.broadcast(flat)
            else:
                self.weight_sync.receive(flat)
            if apply:
                parts = unpack(flat, shapes)
                if slices is not None:
                    parts = [placed(targets[n], part) for n, part in zip(names, parts, strict=True)]
                self.rollout.update_weights(zip(names, parts, strict=True))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- an asynchronous run: the stream's local end is self.stream_host (stream/host.py) ----
    def stream_receive_weights(self, units, dtype: str, version: int) -> float:
        """The broadcast weights into the engine between two of its steps (one_step: once its groups
        have finished); returns the seconds waited for them."""
        return self.stream_host.update_weights(lambda _engine: self.receive_weights(units, dtype), version)

    def sampled_weights(self, plan) -> dict | None:
        return self.rollout.sampled_weights(plan)

    def take_memory_metrics(self) -> dict[str, float]:
        peak, self.peak = self.peak, 0.0
        return {"perf/max_memory_allocated_gb/gen": peak} if peak else {}
