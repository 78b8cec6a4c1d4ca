"""The rollout engine. Requests: `add_request`, `step` (each sample's new tokens), `abort`;
`generate` is a loop over them. And `update_weights`, `sleep`, `wake`. A step is a prefill of the
prompts admitted, else one run of decode steps (decode_runs.py)."""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from hybridflow.devices import follow_free_cores
from hybridflow.engine.config import EngineConfig, page_size_for
from hybridflow.engine.decode_runs import DecodeRuns
from hybridflow.engine.fused_decode import fuse_projections
from hybridflow.engine.kv_cache import KVCache, pool_pages
from hybridflow.engine.requests import RequestOutput, SampleSoFar, check_request, request_samples
from hybridflow.engine.runner import Runner
from hybridflow.engine.sampled import SampledRun
from hybridflow.engine.scheduler import Scheduler
from hybridflow.engine.sequence import PrefillJob, Sequence, record_run
from hybridflow.engine.speculation import Speculation
from hybridflow.engine.weights import WeightUpdater, engine_model, weight_targets
from hybridflow.errors import UserError
from hybridflow.models.native.model import NativeCausalLM
from hybridflow.rollout.sampling import Generation, SamplingParams
from hybridflow.tracking.progress import bar

STOP_SETS_KEPT = 64  # stop-id tensors kept for reuse (each distinct set of stop ids has one)


if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from hybridflow.engine.tensor_parallel import EngineTP


class Engine:
    """Paged, continuously batched generation with our model. With `share_weights` (same device and
    dtype as the trainer, e.g. CPU) the engine runs the trainer's module itself and
    `update_weights` has nothing to copy; otherwise it keeps its own copy."""

    def __init__(
        self,
        model: NativeCausalLM,
        *,
        eos_token_ids: list[int],
        config: EngineConfig | None = None,
        device: torch.device | str | None = None,
        tp_mesh: DeviceMesh | None = None,
    ) -> None:
        """tp_mesh: a 1-D mesh named 'tp' over which this engine is one of a tensor-parallel group
        (engine/tensor_parallel.py): every rank builds it from the same whole model and is given the
        same requests and weight updates."""
        self.config = c = config or EngineConfig()
        self.tp: EngineTP | None = None
        if tp_mesh is not None:  # a group of one too (bench/engine_tp_graphs_check.py: one GPU)
            from hybridflow.engine.tensor_parallel import EngineTP

            self.tp = EngineTP(tp_mesh)
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        if c.page_size is None:
            self.config = c = replace(c, page_size=page_size_for(self.device))
        master = next(model.parameters()).dtype
        if c.compute_dtype == "auto":
            self.compute_dtype = torch.bfloat16 if self.device.type == "cuda" else master
        else:
            self.compute_dtype = getattr(torch, c.compute_dtype)
        shared = (
            c.share_weights
            and self.tp is None
            and self.device == next(model.parameters()).device
            and self.compute_dtype == master
        )
        self.model = model if shared else engine_model(model, self.device, self.compute_dtype)
        if self.tp is not None:
            self.tp.shard(self.model, self.compute_dtype)
        elif not shared:
            fuse_projections(self.model)  # q/k/v and gate/up as views of one tensor each
        self._shares_trainer_module = shared
        self._weights_stamp = self._stamp()
        self._update = WeightUpdater(weight_targets(self.model))
        self.eos_token_ids = list(eos_token_ids)
        mc = self.model.config
        kv_dtype = self.compute_dtype
        if c.exact_logprobs:
            self._check_exact()
        kv_heads = self.tp.kv_heads(self.model) if self.tp is not None else mc.num_key_value_heads
        routes = None
        if c.record_routes:
            if mc.moe is None:
                raise UserError(
                    "rollout routes are recorded for mixture-of-experts models only; this one is dense"
                )
            routes = (len(mc.moe.sparse_layers), mc.moe.top_k)
        self.page_bytes = KVCache.bytes_per_page(
            mc.num_hidden_layers, c.page_size, kv_heads, mc.head_dim, kv_dtype, routes
        )
        self.num_pages = self._pool_pages()
        self.cache = KVCache(
            num_layers=mc.num_hidden_layers,
            num_pages=self.num_pages,
            page_size=c.page_size,
            kv_heads=kv_heads,
            head_dim=mc.head_dim,
            dtype=kv_dtype,
            device=self.device,
            routes=routes,
        )
        self.runner = Runner(
            self.model,
            self.cache,
            compute_dtype=self.compute_dtype,
            max_batch=c.max_batch_sequences,
            max_context=c.max_context_tokens,
            # a tensor-parallel copy's graphs hold its all-reduces and the logits' gather (NCCL captures
            # them; every rank captures and replays the same buckets, as it runs the same steps)
            cuda_graphs=c.cuda_graphs,
            compile_layers=c.compile_layers and self.tp is None,
            # the Triton kernels run on CUDA, and on CPU tensors in Triton's interpreter (tests); their
            # tiles span a head in two halves of a power-of-two size. A tensor-parallel copy runs the
            # trainer's modules under its plan (the fused layers have no all-reduce)
            fused_decode=c.fused_decode
            and self.tp is None
            and mc.moe is None  # the fused layers are dense; an MoE model runs its own modules
            and (self.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
            and mc.head_dim >= 4
            and mc.head_dim & (mc.head_dim - 1) == 0,
            onednn_layers=c.fused_decode and self.tp is None,
            decode_steps=c.decode_steps,
            exact=c.exact_logprobs,
            head=self.tp.logits(self.model) if self.tp is not None else None,
            check_capture=self.tp.check_capture if self.tp is not None else None,
        )
        if c.speculative.enabled and self.tp is not None:
            raise ValueError(
                "speculative decoding: a tensor-parallel engine is not covered yet (set "
                "num_speculative_tokens 0, or rollout.tensor_parallel_size 1)"
            )
        # speculative decoding's drafter, gate and counters (None: off)
        self.speculation = Speculation(c.speculative, self.device) if c.speculative.enabled else None
        self.asleep = False
        self.paused = False
        self.weight_version = 0  # +1 at each update_weights; every output says which it was sampled with
        self.recomputed_tokens = 0  # tokens of generated sequences prefilled again, K/V recomputed
        # where generation's time goes: prefill and decode runs, the decode steps they took, and the
        # milliseconds of each (each run ends in its one sync, so these are the device's time too)
        self.runs = dict.fromkeys(("prefill_runs", "prefill_ms"), 0)
        self.stats: dict[str, float] = {}
        self.scheduler = self._new_scheduler()
        self.decoding = DecodeRuns(
            self.runner, steps=c.decode_steps, exact=c.exact_logprobs, max_rows=c.max_batch_sequences,
            device=self.device, stops_for=self._stops_for, record=self._record,
            speculation=self.speculation, tensor_parallel=self.tp,
        )  # fmt: skip
        self._requests: dict[str, list[Sequence]] = {}  # running requests' samples, by request id
        self._next_seq_id = 0
        # stop-id tensors of recent parameter sets, bounded: every distinct set a client sends would
        # otherwise stay for the engine's life
        self._stops: collections.OrderedDict[tuple, torch.Tensor] = collections.OrderedDict()

    def _check_exact(self) -> None:
        """exact_logprobs' conditions, each refused in one line (ValueError) naming what is not exact yet."""
        from hybridflow.kernels.launch import supported
        from hybridflow.models.native.model import exact_kernels_refusal

        if not supported(self.device):
            raise ValueError(
                f"exact log-probs run Triton kernels, on CUDA only (this engine is on {self.device})"
            )
        if self.tp is not None:
            raise ValueError("exact log-probs: a tensor-parallel engine is not covered yet")
        problem = exact_kernels_refusal(self.model)
        if problem:
            raise ValueError(f"exact log-probs: {problem}")

    def _new_scheduler(self) -> Scheduler:
        c = self.config
        return Scheduler(
            self.cache,
            max_sequences=c.max_batch_sequences,
            max_prefill_tokens=c.max_prefill_tokens,
            max_pages_per_sequence=self.runner.max_pages,
            prefix_cache=c.prefix_cache,
        )

    def resize_pool(self) -> None:
        """Size the KV pool again from the GPU memory free now (gpu_memory_utilization of it), e.g.
        once the trainer has sharded or offloaded the models that were whole when the engine was
        built. A pool of fixed size (kv_cache_tokens), or off the GPU, stays as it is."""
        if self.config.kv_cache_tokens is not None or self.device.type != "cuda":
            return
        awake = not self.asleep
        self.sleep()
        self.cache.resize(self._pool_pages())
        self.num_pages = self.cache.num_pages
        self.scheduler = self._new_scheduler()  # over the new pool (no request runs: sleep checked)
        if awake:
            self.wake()

    def _pool_pages(self) -> int:
        """The pool's pages, page 0 (reserved) included, from the GPU memory free now (a split engine
        takes its ranks' smallest)."""
        c = self.config
        on_gpu = c.kv_cache_tokens is None and self.device.type == "cuda"
        pages = pool_pages(c, self.page_bytes, torch.cuda.mem_get_info(self.device)[0] if on_gpu else None)
        if self.tp is not None:
            pages = self.tp.fewest(pages)
        return pages + 1  # page 0 is reserved

    # ----------------------------------------------------------------------------------- public
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        resume: list[SampleSoFar | None] | None = None,
    ) -> None:
        """Queue `params.n` samples of one prompt; they share continuous batching with every other
        request. Sample j draws from the stream (params.seed, params.first_sequence + j), so a
        request samples the same tokens whatever else runs beside it (a random seed when None).
        `resume[j]`: sample j's tokens from an earlier run; it goes on from there (its K/V recomputed,
        as after a preemption) or, finished, stays as it is; only new tokens are reported."""
        c = self.config
        if request_id in self._requests:
            raise UserError(f"request {request_id!r} is already running")
        check_request(
            request_id, prompt_token_ids, params, c.max_context_tokens, self.model.config.vocab_size
        )
        base = params.seed if params.seed is not None else self._random_seed()
        group = request_samples(request_id, prompt_token_ids, params, resume, first_seq_id=self._next_seq_id,
                                seed=base, max_context=c.max_context_tokens)  # fmt: skip
        self._next_seq_id += len(group)
        self._requests[request_id] = group
        fresh = [s for s in group if not s.num_generated and not s.finished]
        for k in range(0, len(fresh), c.max_batch_sequences):  # a job never outgrows the batch
            self.scheduler.add(PrefillJob(fresh[k : k + c.max_batch_sequences]))
        for s in group:  # prefilled alone with its tokens so far, as a preempted sequence is
            if s.num_generated and not s.finished:
                self.scheduler.add(PrefillJob([s]))

    def _random_seed(self) -> int:
        if self.tp is not None:  # the group's ranks must draw the same tokens
            return self.tp.seed()
        return int(torch.randint(0, 2**31 - 1, ()))

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Stop a request now: its pages are freed; its unfinished samples end with 'abort'."""
        group = self._requests.pop(request_id, None)
        if group is None:
            return []
        self.scheduler.drop_waiting(group)
        outputs = []
        for s in group:
            if s.finished:
                continue
            if s.seq_id in self.scheduler.running:
                self.scheduler.finish(s)
            if self.speculation is not None:
                self.speculation.finished(s)
            s.finish_reason = "abort"
            outputs.append(RequestOutput(request_id, s.sample, finish_reason="abort"))
        return outputs

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[RequestOutput]:
        """One scheduling step: a prefill of newly admitted prompts, else a run of decode steps.
        Returns each sample that advanced: its new tokens, and its finish reason on the last."""
        if self.device.type == "cpu":
            follow_free_cores()  # torch's threads on the cores other work leaves free
        outputs = []
        for s in self._step():
            done, s.reported = s.reported, s.num_generated
            outputs.append(
                RequestOutput(s.request_id, s.sample, s.tokens[s.prompt_len + done :], s.logprobs[done:],
                              s.unscaled_logprobs[done:], s.finish_reason, self.weight_version, s.routes)
            )  # fmt: skip
        return outputs

    def _step(self) -> list[Sequence]:
        """The step itself; returns the sequences that advanced (a finished request is forgotten)."""
        if self.asleep:
            raise RuntimeError("the engine is asleep; call wake() first")
        if self.paused or not self.scheduler.has_work:
            return []
        if (
            self._shares_trainer_module
            and self.cache.pool.num_cached
            and self._stamp() != self._weights_stamp
        ):
            self._weights_changed()  # the trainer stepped the module we run without an update_weights
        # (a run launched ahead is read first)
        jobs = self.scheduler.schedule_prefill() if self.decoding.ahead is None else []
        batch = self._prefill(jobs) if jobs else self.decoding.run(self.scheduler)
        for s in batch:
            group = self._requests.get(s.request_id) if s.finished else None
            if group is not None and all(x.finished for x in group):
                del self._requests[s.request_id]
        return batch

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[Generation]:
        """n generations per prompt, prompt-major: outputs[i * n + j] is sample j of prompt i. A loop
        over the request API: sequence i*n + j draws from (seed, first_sequence + i*n + j), as before."""
        if self.asleep or self.paused:
            raise RuntimeError(
                f"the engine is {'asleep' if self.asleep else 'paused'}; call {'wake' if self.asleep else 'resume'}() first"
            )
        base = params.seed if params.seed is not None else self._random_seed()
        ids = [f"generate-{self._next_seq_id}-{i}" for i in range(len(prompt_token_ids))]
        for i, prompt in enumerate(prompt_token_ids):
            check_request(
                i, prompt, params, self.config.max_context_tokens, self.model.config.vocab_size
            )  # all first
        for i, (request_id, prompt) in enumerate(zip(ids, prompt_token_ids)):
            first = params.first_sequence + i * params.n
            self.add_request(request_id, prompt, replace(params, seed=base, first_sequence=first))
        seqs = [s for request_id in ids for s in self._requests[request_id]]
        for s, i in zip(seqs, (i for i in range(len(ids)) for _ in range(params.n))):
            s.prompt_index = i
        scheduler = self.scheduler
        preempted, start, steps = scheduler.preemptions, time.perf_counter(), 0
        captured = self.runner.capture_seconds
        admitted, cached = scheduler.admitted_tokens, scheduler.cached_tokens
        speculated = dict(self.speculation.counts) if self.speculation is not None else {}
        finished = bar(len(seqs), "generate", enabled=self.config.progress, inner=True)
        mine, left = set(ids), len(seqs)
        while left:  # straight on the sequences: the trainer's path builds no per-step outputs
            ended = sum(s.finished for s in self._step() if s.request_id in mine)
            left -= ended
            finished.update(ended)
            steps += 1
        finished.close()
        if not self.scheduler.has_work:
            assert self.cache.pool.num_free == self.cache.pool.num_pages, "pages leaked"
        self.stats = {
            "steps": steps,
            "preemptions": self.scheduler.preemptions - preempted,
            "prefill_tokens": scheduler.admitted_tokens - admitted,  # prompts, and recomputed sequences
            "prefix_cached_tokens": scheduler.cached_tokens - cached,
            "tokens": sum(s.num_generated for s in seqs),
            "seconds": time.perf_counter() - start,
            "graph_capture_seconds": self.runner.capture_seconds - captured,  # included in seconds
        }
        if self.speculation is not None:
            self.stats.update(
                {f"speculative_{k}": v - speculated[k] for k, v in self.speculation.counts.items()}
            )
        return [
            Generation(
                s.prompt_index,
                s.tokens[s.prompt_len :],
                s.logprobs,
                s.finish_reason,
                s.unscaled_logprobs,
                s.routes,
            )  # fmt: skip
            for s in seqs
        ]

    def counters(self) -> dict[str, int]:
        """Since the engine was made: tokens prefilled again (recomputed_tokens); its prefill and decode
        runs, decode steps and their milliseconds, graph captures' milliseconds (among them); and,
        speculating, its steps, tokens drafted, drafts accepted and tokens those steps produced
        (speculative_*)."""
        counts = self.speculation.counts if self.speculation is not None else {}
        return (
            {
                "recomputed_tokens": self.recomputed_tokens,
                "graph_capture_ms": round(1e3 * self.runner.capture_seconds),
            }
            | self.runs
            | self.decoding.counts
            | {f"speculative_{k}": v for k, v in counts.items()}
        )

    def prefix_cache_stats(self) -> dict[str, float]:
        """Since the engine was made: tokens admitted to prefill, those found cached, and the ratio."""
        s = self.scheduler
        return {
            "prompt_tokens": s.admitted_tokens,
            "cached_tokens": s.cached_tokens,
            "hit_rate": s.cached_tokens / s.admitted_tokens if s.admitted_tokens else 0.0,
            "cached_pages": self.cache.pool.num_cached,
        }

    def serving_stats(self) -> dict[str, int]:
        """The scheduler's and the pool's state for a server's metrics (plain reads: safe beside
        the thread that steps)."""
        s, pool = self.scheduler, self.cache.pool
        return {
            "waiting": len(s.waiting),
            "running": len(s.running),
            "kv_pages_used": pool.num_pages - pool.num_free,
            "kv_pages_total": pool.num_pages,
            "prefix_cache_pages": pool.num_cached,
            "admitted_tokens": s.admitted_tokens,
            "cached_tokens": s.cached_tokens,
            "weight_version": self.weight_version,
            "preemptions": s.preemptions,
            "recomputed_tokens": self.recomputed_tokens,
        }

    def _stops_for(self, params: SamplingParams) -> torch.Tensor:
        """The stop tokens of sequences sampled with `params`, on the device (made once per set)."""
        key = tuple(sorted(set(self.eos_token_ids) | set(params.stop_token_ids)))
        if key in self._stops:
            self._stops.move_to_end(key)
        else:
            self._stops[key] = torch.tensor(key, dtype=torch.int64).to(self.device)
            while len(self._stops) > STOP_SETS_KEPT:
                self._stops.popitem(last=False)
        return self._stops[key]

    def _prefill(self, jobs: list[PrefillJob]) -> list[Sequence]:
        """Prefill the jobs' prompts and sample every sequence's next token."""
        started = time.perf_counter()
        batch = [s for job in jobs for s in job.seqs]
        if self.tp is not None:
            self.tp.check_same_step("prefill", batch, prompts=[job.tokens for job in jobs])
        self.recomputed_tokens += sum(  # sequences with tokens of their own: preempted, updated, resumed
            len(job.tokens) - job.seqs[0].cached for job in jobs if job.seqs[0].num_generated
        )
        logits = self.runner.prefill(jobs)  # [J, V]
        rows = torch.tensor([j for j, job in enumerate(jobs) for _ in job.seqs], device=logits.device)
        logits = logits.index_select(0, rows)  # the samples of a prompt share its logits
        for s in batch:
            s.cached = len(s.tokens)
        sampled = SampledRun(
            batch, self._stops_for, steps=1, device=logits.device, exact=self.config.exact_logprobs
        )
        sampled.draw(logits, 0)
        self._record(batch, sampled.fetch(), [1] * len(batch))
        self.runs["prefill_runs"] += 1
        self.runs["prefill_ms"] += round(1e3 * (time.perf_counter() - started))
        for job in jobs:  # the prompt's full pages, for requests that arrive while these run
            live = next((s for s in job.seqs if not s.finished), None)
            if live is not None:
                self.scheduler.register(live)
        return batch

    def _record(self, batch, run: np.ndarray, limits: list[int]) -> None:
        """Append each sequence's tokens of the run (sequence.record_run); retire the finished ones."""
        finished = record_run(batch, run, limits)
        if finished and self.cache.routes is not None:  # read before the pages go
            kept = self.cache.read_routes([(s.pages, len(s.tokens) - 1) for s in finished])
            for s, routes in zip(finished, kept):
                s.routes = routes
        for s in finished:
            self.scheduler.finish(s)
            if self.speculation is not None:
                self.speculation.finished(s)

    def pause(self) -> None:
        """Stop scheduling: `step()` does nothing until `resume()`; running requests keep their tokens."""
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def set_aside(self) -> None:
        """Requests in flight leave the schedule until `bring_back()` (tokens kept, K/V recomputed):
        a batch added meanwhile runs alone, as on an idle engine."""
        self.decoding.drop_ahead()
        self.scheduler.set_aside()

    def bring_back(self) -> None:
        self.scheduler.bring_back()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy trainer tensors into the engine's weights in place (captured graphs stay valid);
        returns the bytes written (0 when the engine runs the trainer's own module). Requests in
        flight keep their tokens but lose their cached K/V (computed with the old weights): they are
        prefilled again, prompt and tokens so far, at their next step, and sample on with the new
        weights (`weight_version` says which); with `keep_kv_on_weight_update` they keep their K/V."""
        self.decoding.drop_ahead()  # (it reads the weights written here)
        written = self._update(named_tensors)
        self._weights_changed()
        return written

    def _weights_changed(self) -> None:
        self.decoding.drop_ahead()
        self.weight_version += 1
        self.scheduler.weights_changed(keep_kv=self.config.keep_kv_on_weight_update)
        self.cache.pool.forget_prefixes()  # every cached K/V was computed with the old weights
        self._weights_stamp = self._stamp()

    def _stamp(self) -> int:
        """Changes whenever any weight is written in place (an optimizer step, a copy): the sum of
        the parameters' version counters."""
        return sum(p._version for p in self.model.parameters())

    @property
    def shares_trainer_module(self) -> bool:
        """It runs the trainer's module itself (no copy of its own)."""
        return self._shares_trainer_module

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        """The engine's weights under the trainer's parameter names (for the weight-sync check)."""
        return {name: tensors[0] for name, tensors in self._update.targets.items()}

    def sleep(self) -> None:
        """Free the KV pool and the captured graphs so that training gets the memory; requests in flight
        keep their tokens and are prefilled again after `wake()` (as after a weight update)."""
        self.decoding.drop_ahead()
        self.scheduler.preempt_all()
        self.runner.drop_graphs()
        self.cache.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.asleep = True

    def wake(self) -> None:
        self.cache.allocate()
        self.asleep = False
