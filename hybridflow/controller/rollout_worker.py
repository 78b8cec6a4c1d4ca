"""A rollout worker of a disaggregated placement: a GPU (or CPU slot) that holds only the rollout
engine, with a full copy of the policy, and receives the actor's weights by broadcast after each
update instead of sharing a GPU with the trainer."""

from __future__ import annotations

from pathlib import Path

import torch

from hybridflow.agents.setup import agent_loop
from hybridflow.batch import Prompt, Rollouts
from hybridflow.config.schema import Config
from hybridflow.controller.role_models import policy_model, rollout_backend
from hybridflow.controller.worker_models import engine_mesh
from hybridflow.devices import DTYPES, resolve_device
from hybridflow.models import load_causal_lm
from hybridflow.parallel.weight_sync import WeightSync, unpack
from hybridflow.rewards.hidden import hidden_paths
from hybridflow.roles.rollout import Rollout
from hybridflow.rollout.sampling import SamplingParams


class RolloutWorker:
    """Built by a worker group as `RolloutWorker(config, rank, world_size)`."""

    def __init__(self, config: Config, rank: int, world_size: int) -> None:
        c = self.config = config
        self.rank = rank
        self.device = resolve_device(c.resources.device)
        torch.manual_seed(c.trainer.seed)
        hf_model, tokenizer = load_causal_lm(c.model.path, dtype=c.model.dtype, cache_dir=c.model.cache_dir)
        policy = policy_model(c, hf_model).to(self.device)  # the engine copies it (the actor's start)
        if c.rollout.backend == "hf":
            hf_model.to(self.device)
        # rollout.tensor_parallel_size: consecutive rollout workers split one engine (each takes its
        # slices of every whole layer the actor's rank 0 broadcasts)
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
        self.weight_sync: WeightSync | None = None
        self.peak = 0.0

    def join_weight_sync(self, master: tuple[str, int], sync_rank: int, sync_size: int) -> None:
        self.weight_sync = WeightSync(master, sync_rank, sync_size, self.device)

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
        """The actor's weights, one broadcast per unit of (name, shape) pairs, into the engine
        (`apply=False`: received and dropped, a worker that holds them already while a replaced one
        catches up)."""
        for unit in units:
            flat = torch.empty(
                sum(torch.Size(s).numel() for _, s in unit), dtype=DTYPES[dtype], device=self.device
            )
            self.weight_sync.broadcast(flat)
            if apply:
                self.rollout.update_weights(zip((n for n, _ in unit), unpack(flat, [s for _, s in unit])))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- an asynchronous run: a GroupStream over this worker's engine (controller/remote_stream.py) ----
    def open_stream(self, version: int, in_flight_updates: bool, deadline_s: float) -> None:
        from hybridflow.controller.group_stream import GroupStream

        self.stream = GroupStream(
            self.rollout.backend,
            None,  # the controller scores what `stream_poll` hands over
            agent=self.rollout.agent,
            version=version,
            in_flight_updates=in_flight_updates,
            deadline_s=deadline_s,
        )

    def stream_submit(self, prompts: list[Prompt], params: SamplingParams, first_group: int) -> None:
        self.stream.submit(prompts, params, first_group)

    def stream_poll(self) -> tuple[list[tuple[int, Rollouts]], int]:
        """Groups finished since the last poll, and how many are still running."""
        return self.stream.poll(), self.stream.running

    def stream_receive_weights(self, units, dtype: str, version: int) -> float:
        """The broadcast weights into the engine between two of its steps (one_step: once its groups
        have finished); returns the seconds waited for them."""
        return self.stream.update_weights(lambda _engine: self.receive_weights(units, dtype), version)

    def stream_generate(self, prompts: list[Prompt], params: SamplingParams) -> Rollouts:
        return self.stream.generate_now(prompts, params)

    def stream_idle_seconds(self) -> float:
        return self.stream.take_idle_seconds()

    def close_stream(self) -> None:
        if getattr(self, "stream", None) is not None:
            self.stream.close()
            self.stream = None

    def sampled_weights(self, plan) -> dict | None:
        return self.rollout.sampled_weights(plan)

    def take_memory_metrics(self) -> dict[str, float]:
        peak, self.peak = self.peak, 0.0
        return {"perf/max_memory_allocated_gb/gen": peak} if peak else {}
