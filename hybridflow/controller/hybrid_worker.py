"""One rank of the hybrid engine: the actor, reference, critic and rollout roles of one GPU (or CPU
slot) in one process, each still its own class. With several ranks the trained models are sharded
with FSDP2 over all of them, and the rollout engine keeps a full copy that `sync_weights` refreshes
one FSDP unit (decoder layer) at a time."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from hybridflow.agents.setup import agent_loop
from hybridflow.batch import Prompt, Rollouts, TrainingBatch
from hybridflow.config.schema import Config
from hybridflow.controller.policy_export import export_policy
from hybridflow.controller.role_models import (
    compile_native_models,
)
from hybridflow.controller.worker_models import build_models
from hybridflow.devices import resolve_device
from hybridflow.models.lora import LoRALinear, lora_modules
from hybridflow.parallel.checkpoint import load_sharded, save_sharded
from hybridflow.parallel.offload import CPU, move_optimizer_state, optimizer_state_on
from hybridflow.parallel.reshard import ReshardPlan, part_of
from hybridflow.parallel.weight_check import Plan, make_plan, sample, trainer_tensors
from hybridflow.parallel.weight_sync import WeightSync, pack
from hybridflow.rewards.hidden import hidden_paths
from hybridflow.roles.actor import Actor
from hybridflow.roles.critic import Critic
from hybridflow.roles.reference import Reference
from hybridflow.roles.rollout import Rollout
from hybridflow.rollout.sampling import SamplingParams
from hybridflow.stream.host import StreamHost


class HybridWorker:
    """Built by a worker group as `HybridWorker(config, rank, world_size, total_steps=..., kv_pool_tokens=...)`
    (`kv_pool_tokens`: the engine's KV pool as the memory plan sized it before the workers started)."""

    def __init__(self, config: Config, rank: int, world_size: int, *, total_steps: int,
                 kv_pool_tokens: int | None = None) -> None:  # fmt: skip
        c = self.config = config
        self.rank, self.world_size = rank, world_size
        self.device = resolve_device(c.resources.device)
        built = build_models(c, world_size, self.device, kv_pool_tokens=kv_pool_tokens)
        self.tokenizer, self.hf_config, self.lora = built.tokenizer, built.hf_config, built.lora
        self._own_process_group = built.own_process_group
        model, ref_model, critic_model, backend = (
            built.model,
            built.ref_model,
            built.critic_model,
            built.backend,
        )
        pad = self.tokenizer.pad_token_id
        self.actor = Actor(
            model,
            c.actor,
            total_steps=total_steps,
            max_response_tokens=c.data.max_response_tokens,
            pad_token_id=pad,
            gradient_checkpointing=c.model.enable_gradient_checkpointing,
            device=self.device,
            progress=c.trainer.progress,
            temperature=c.rollout.temperature or 1.0,
        )
        self.ref = (
            Reference(
                ref_model,
                max_tokens_per_microbatch=c.ref.max_tokens_per_microbatch,
                compute_dtype=c.actor.compute_dtype,
                pad_token_id=pad,
                device=self.device,
                temperature=c.rollout.temperature or 1.0,
                adapters_off=ref_model is model,
            )
            if ref_model is not None
            else None
        )
        self.critic = (
            Critic(
                critic_model,
                c.critic,
                total_steps=total_steps,
                compute_dtype=c.actor.compute_dtype,
                pad_token_id=pad,
                device=self.device,
            )
            if critic_model is not None
            else None
        )
        if c.model.compile:  # after the reference copy: compiled layers do not deep-copy
            compile_native_models(
                [m for m in dict.fromkeys((model, ref_model, critic_model)) if m is not None]
            )
        agent = agent_loop(c.rollout.agent, self.tokenizer, c.data.max_response_tokens, hidden_paths(c))
        self.rollout = Rollout(backend, agent) if built.layout.colocated else None
        # an asynchronous run's local end of the stream of groups, over this worker's engine
        self.stream_host = StreamHost(backend, agent) if self.rollout is not None else None
        if self.lora and self.rollout is not None:  # a loaded adapter: the backend starts from the base
            for unit in self._merged_units():
                self.rollout.update_weights(unit)
        self.weight_sync: WeightSync | None = None  # disaggregated: rank 0's link to the rollout workers
        self.rollout_slices: list[dict] | None = None  # rank 0, engines split over rollout workers
        self._reshard: ReshardPlan | None = None  # an engine split over TP ranks: made at the first sync
        # with offload_params the optimizer lives (and steps) on the CPU already
        self.offload_actor_optimizer = c.actor.offload_optimizer and not c.actor.offload_params
        sharded, engine_empty = built.layout.sharded, built.engine_empty
        del built  # the native engine has its own copy of the weights now (the hf backend keeps this one)
        if sharded and hasattr(backend, "resize_pool"):  # the native engine
            backend.resize_pool()  # built beside whole models, which are sharded or offloaded now
        if c.rollout.server and self.rollout is not None:  # agents reach the policy by URL
            from hybridflow.serve.served_backend import serve_policy

            self.rollout.backend = serve_policy(
                backend, self.tokenizer, c, world_size, Path(c.trainer.run_dir)
            )
        self.peaks: dict[str, float] = {}
        if engine_empty:  # built to the shape of a policy read shard by shard: its weights now
            self.sync_weights()

    @contextmanager
    def _phase(self, name: str):
        """Records the phase's peak GPU memory (GiB) for `take_memory_metrics`."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        yield
        if cuda:
            peak = torch.cuda.max_memory_allocated(self.device) / 2**30
            self.peaks[name] = max(self.peaks.get(name, 0.0), peak)

    # ---- the roles, as the controller calls them ----------------------------------------------
    def generate(self, prompts: list[Prompt], params: SamplingParams, first_group: int = 0) -> Rollouts:
        assert self.rollout is not None, "disaggregated: the rollout workers generate"
        with self._phase("gen"):
            return self.rollout.generate(prompts, params, first_group=first_group)

    def stream_sync_weights(self, version: int) -> float:
        """An asynchronous run's update: `sync_weights` between two steps of this worker's engine
        (one_step: once its groups have finished), which then holds policy `version`; the seconds
        waited. Every rank calls it (a sharded actor gathers each layer with the others)."""
        return self.stream_host.update_weights(lambda _engine: self.sync_weights(), version)

    def sleep_rollout(self) -> None:
        """On a GPU, the engine's KV cache is freed while the other roles run (unless
        rollout.free_cache_engine=false keeps it)."""
        if self.device.type == "cuda" and self.rollout is not None and self.config.rollout.free_cache_engine:
            self.rollout.sleep()

    def log_probs(self, batch: TrainingBatch) -> torch.Tensor:
        with self._phase("old_log_prob"):
            return self.actor.log_probs(batch)[0]

    def log_probs_and_routes(self, batch: TrainingBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The old policy's log-probs and the experts its pass routed each sequence's tokens to (R2)."""
        routes: list = [None] * len(batch)
        with self._phase("old_log_prob"):
            return self.actor.log_probs(batch, routes=routes)[0], routes

    def ref_log_probs(self, batch: TrainingBatch) -> torch.Tensor:
        with self._phase("ref"):
            return self.ref.log_probs(batch)

    def values(self, batch: TrainingBatch) -> torch.Tensor:
        with self._phase("values"):
            return self.critic.values(batch)

    def update_actor(self, minibatches: list[TrainingBatch]) -> dict[str, float]:
        """With actor.offload_optimizer, Adam's state is on the GPU for this call only."""
        with self._phase("update_actor"), self._actor_optimizer_on_gpu():
            return self.actor.update_minibatches(minibatches)

    def _actor_optimizer_on_gpu(self):
        return optimizer_state_on(self.actor.optimizer, self.device, enabled=self.offload_actor_optimizer)

    def update_critic(self, minibatches: list[TrainingBatch], epochs: int) -> dict[str, float]:
        with self._phase("update_critic"):
            return self.critic.update_minibatches(minibatches, epochs=epochs)

    @torch.no_grad()
    def sync_weights(self) -> None:
        """Copy the actor's weights into the rollout engine in place — this worker's own, or,
        disaggregated, the rollout workers' by broadcast from rank 0. Sharded, one FSDP unit at a
        time is gathered (a decoder layer, then the embedding, final norm and head), so no more than
        one layer's full weights exist beyond the engine's copy; an engine split over TP ranks gathers
        nothing: each rank receives the parts of its slices that it does not hold (parallel/reshard.py)."""
        with self._phase("update_weights"):
            model = self.actor.model
            if self.rollout is not None and self.lora:  # only the adapted layers change: their merged weights
                for unit in self._merged_units():
                    self.rollout.update_weights(unit)
            elif self._split_engine_from_shards():  # each rank receives only what its slice lacks
                for unit in self._reshard_plan().run(dict(model.named_parameters())):
                    self.rollout.update_weights(unit)
            elif self.rollout is not None and not isinstance(model, FSDPModule):
                self.rollout.update_weights(model.named_parameters())  # the cached copy plan
            else:  # LoRA on rollout workers: the adapted layers merged, all that changes
                units = self._merged_units() if self.lora else self._gathered_units()
                for unit in units:
                    if self.rollout is not None:
                        self.rollout.update_weights(unit)
                    elif self.weight_sync is not None and self.rollout_slices is not None:  # rank 0
                        for i, boxes in enumerate(self.rollout_slices):  # engines split over workers
                            self.weight_sync.send(pack([part_of(t, boxes[n]) for n, t in unit]), 1 + i)
                    elif self.weight_sync is not None:  # rank 0
                        self.weight_sync.broadcast(pack([t for _, t in unit]))
        if self.device.type == "cuda":  # the controller times this call: include the copies
            torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def weight_samples(self, step: int) -> tuple[Plan, dict, dict | None]:
        """The weight-sync check's plan for `step`, the trainer's sampled values and (colocated) the
        engine's; every rank calls it (a sharded parameter is gathered)."""
        tensors = trainer_tensors(self.actor.model)
        plan = make_plan(tensors, step)
        trainer = sample(tensors, plan)
        return plan, trainer, self.rollout.sampled_weights(plan) if self.rollout is not None else None

    def _split_engine_from_shards(self) -> bool:
        """A colocated engine split over TP ranks, filled from an actor whose every parameter is a
        DTensor (FSDP2, x TP): resharded point to point (parallel/reshard.py)."""
        return (
            self.rollout is not None
            and self.config.rollout.tensor_parallel_size > 1
            and hasattr(self.rollout.backend, "weight_tensors")
            and all(isinstance(p, DTensor) for p in self.actor.model.parameters())
        )

    def _reshard_plan(self) -> ReshardPlan:
        """Made at the first sync, from the boxes every rank holds and needs (a collective)."""
        if self._reshard is None:
            model = self.actor.model
            names = [name for name, _ in model.named_parameters()]
            units = [[n for n in names if _in_unit(n, prefix)] for prefix, _ in _fsdp_units(model)]
            self._reshard = ReshardPlan(
                dict(model.named_parameters()), self.rollout.backend.weight_tensors(), units
            )
        return self._reshard

    def _gathered_units(self):
        """(name, full tensor) pairs of the actor, one FSDP unit at a time."""
        model = self.actor.model
        sharded = isinstance(model, FSDPModule)
        for prefix, unit in _fsdp_units(model):
            if sharded:
                unit.unshard()
            yield [(name, _full(p)) for name, p in model.named_parameters() if _in_unit(name, prefix)]
            if sharded:
                unit.reshard()

    def _merged_units(self):
        """LoRA: (name, merged weight) pairs of the adapted layers, all that trains, one FSDP unit at
        a time (sharded, each decoder layer is gathered for its merge, then freed)."""
        sharded = isinstance(self.actor.model, FSDPModule)
        for unit, layers in _adapted_units(self.actor.model):
            if sharded:
                unit.unshard()
            yield [(f"{name}.weight", layer.merged_weight()) for name, layer in layers]
            if sharded:
                unit.reshard()

    def weight_manifest(self) -> tuple[list[list[tuple[str, tuple[int, ...]]]], str]:
        """What `sync_weights` broadcasts: (name, shape) per unit, and the dtype of every tensor (with
        LoRA the adapted layers' merged weights, under the engine's names)."""
        model = self.actor.model
        if self.lora:
            units = _adapted_units(model)
            dtype = units[0][1][0][1].base.weight.dtype
            manifest = [[(f"{name}.weight", tuple(layer.base.weight.shape)) for name, layer in layers]
                        for _, layers in units]  # fmt: skip
            return manifest, str(dtype).removeprefix("torch.")
        units = [
            [(name, tuple(p.shape)) for name, p in model.named_parameters() if _in_unit(name, prefix)]
            for prefix, _ in _fsdp_units(model)
        ]
        return units, str(next(model.parameters()).dtype).removeprefix("torch.")

    def join_weight_sync(self, master: tuple[str, int] | None, sync_rank: int, sync_size: int,
                         slices: list[dict] | None = None) -> None:  # fmt: skip
        """Rank 0 joins the rollout workers' weight-sync group (the other ranks are given None); with
        `slices` (each rollout worker's box of every weight: an engine split over them) it sends each
        worker only its slices instead of broadcasting whole layers."""
        if master is not None:
            self.weight_sync = WeightSync(master, sync_rank, sync_size, self.device)
            self.rollout_slices = slices

    def shutdown(self) -> None:
        """An in-process worker ends the one-rank process group that it started for FSDP2 (and the
        policy server, with rollout.server)."""
        if self.stream_host is not None:
            self.stream_host.close()
        if self.rollout is not None and hasattr(self.rollout.backend, "close"):
            self.rollout.backend.close()
        if self._own_process_group:
            torch.distributed.destroy_process_group()
            self._own_process_group = False

    def take_memory_metrics(self) -> dict[str, float]:
        peaks, self.peaks = self.peaks, {}
        return {f"perf/max_memory_allocated_gb/{phase}": gib for phase, gib in peaks.items()}

    # ---- checkpoints ----------------------------------------------------------------------------
    def save(self, directory: str) -> dict | None:
        """Every rank: sharded actor (and critic) weights + optimizer states under DIR/actor_state
        (DIR/critic_state), which any number of ranks can load; rank 0 also exports the policy (and
        critic) as transformers directories. Returns the LR scheduler states (rank 0)."""
        out = Path(directory)
        save_sharded(self.actor.model, self.actor.optimizer, out / "actor_state")
        self._export(self.actor.model, out / "policy", score=False)
        schedulers = {"actor_scheduler": self.actor.scheduler.state_dict()}
        for role, name in ((self.actor, "actor"), (self.critic, "critic")):
            if role is not None and role.loss_scale.enabled:  # float16: the scale goes on from here
                schedulers[f"{name}_loss_scale"] = role.loss_scale.state_dict()
        if self.critic is not None:
            save_sharded(self.critic.model, self.critic.optimizer, out / "critic_state")
            self._export(self.critic.model, out / "critic", score=True)
            schedulers["critic_scheduler"] = self.critic.scheduler.state_dict()
        return schedulers if self.rank == 0 else None

    def checkpoint_bytes(self) -> int:
        """About what `save` writes from this rank: its shards of the trained models with their Adam
        moments (two fp32 values per parameter), and on rank 0 the whole models exported."""
        total = 0
        for role in (self.actor, self.critic):
            for p in role.model.parameters() if role is not None else ():
                local = p.to_local() if hasattr(p, "to_local") else p
                total += local.numel() * (local.element_size() + 8)
                total += p.numel() * p.element_size() if self.rank == 0 else 0
        return total

    def load(self, directory: str, schedulers: dict) -> None:
        path = Path(directory)
        for role, name in ((self.actor, "actor"), (self.critic, "critic")):
            if role is None:
                continue
            load_sharded(role.model, role.optimizer, path / f"{name}_state")
            role.scheduler.load_state_dict(schedulers[f"{name}_scheduler"])
            if f"{name}_loss_scale" in schedulers and role.loss_scale.enabled:
                role.loss_scale.load_state_dict(schedulers[f"{name}_loss_scale"])
        if self.offload_actor_optimizer:
            move_optimizer_state(self.actor.optimizer, CPU)

    def _export(self, model: torch.nn.Module, directory: Path, *, score: bool) -> None:
        export_policy(model, directory, hf_config=self.hf_config, tokenizer=self.tokenizer,
                      base_model=self.config.model.path, rank=self.rank, score=score)  # fmt: skip


def _fsdp_units(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(parameter-name prefix, module) of every FSDP unit: each decoder layer, then the root."""
    layers = [(f"model.layers.{i}.", layer) for i, layer in enumerate(model.model.layers)]
    return [*layers, ("", model)]


def _adapted_units(model: torch.nn.Module) -> list[tuple[torch.nn.Module, list[tuple[str, LoRALinear]]]]:
    """(FSDP unit, its LoRA layers by name) of every unit that holds adapters (none for PEFT's
    adapters on a transformers model, which the hf backend runs itself)."""
    adapted = lora_modules(model)
    if not adapted:
        return []
    units = [
        (unit, [(n, m) for n, m in adapted.items() if _in_unit(n, prefix)])
        for prefix, unit in _fsdp_units(model)
    ]
    return [(unit, layers) for unit, layers in units if layers]


def _in_unit(name: str, prefix: str) -> bool:
    return name.startswith(prefix) if prefix else not name.startswith("model.layers.")


def _full(p: torch.Tensor) -> torch.Tensor:
    """An unsharded parameter as a plain tensor (a DTensor still sharded is gathered)."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
