"""The rollout engine: `generate`, `update_weights`, `sleep`, `wake` — nothing else is public."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from hybridflow.engine.kv_cache import KVCache
from hybridflow.engine.runner import Runner
from hybridflow.engine.sampler import sample, step_keys
from hybridflow.engine.scheduler import Scheduler
from hybridflow.engine.sequence import PrefillJob, Sequence
from hybridflow.engine.weights import WeightUpdater, engine_model, weight_targets
from hybridflow.errors import UserError
from hybridflow.models.native.model import NativeCausalLM
from hybridflow.rollout.sampling import Generation, NonFiniteLogits, SamplingParams
from hybridflow.tracking.progress import bar


def pool_tokens_for(sequences: int, context_tokens: int, page_size: int) -> int:
    """A KV pool that holds `sequences` whole sequences of `context_tokens` at once (each in whole
    pages), plus the one page the scheduler keeps spare: the CPU's pool, sized to a step."""
    return (sequences * -(-context_tokens // page_size) + 1) * page_size


@dataclass
class EngineConfig:
    max_batch_sequences: int = 256
    """Most sequences decoded together (and the largest captured CUDA graph)."""
    max_prefill_tokens: int = 16384
    """Token budget of one prefill step (a longer prompt is prefilled alone)."""
    max_context_tokens: int = 4096
    """Longest prompt + response; a sequence that reaches it stops with finish_reason 'length'."""
    page_size: int = 64
    kv_cache_tokens: int | None = None
    """Size of the KV pool in tokens; by default `gpu_memory_utilization` of the free GPU memory (at
    most room for max_batch_sequences at full context), or that room on CPU."""
    gpu_memory_utilization: float = 0.5
    cuda_graphs: bool = True
    decode_steps: int = 8
    """Decode steps the device runs between two looks of the host: the host plans and records once per
    run while the GPU works on (a sequence that stops in a run computes to its end, at most this many
    steps more; 1: a host round trip per token)."""
    compile_layers: bool = False
    """torch.compile the parts of each layer around attention (fused norms, RoPE, SwiGLU)."""
    compute_dtype: str = "auto"
    """'auto': bfloat16 on CUDA, the model's own dtype elsewhere."""
    progress: bool = False
    """A transient bar of finished sequences during `generate` (on a terminal only)."""
    share_weights: bool = True
    """Run the trainer's module itself when device and dtype match (no copy, nothing to update);
    False keeps a copy (the trainer's module is about to be sharded)."""


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
    ) -> None:
        self.config = c = config or EngineConfig()
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        master = next(model.parameters()).dtype
        if c.compute_dtype == "auto":
            self.compute_dtype = torch.bfloat16 if self.device.type == "cuda" else master
        else:
            self.compute_dtype = getattr(torch, c.compute_dtype)
        shared = (
            c.share_weights
            and self.device == next(model.parameters()).device
            and self.compute_dtype == master
        )
        self.model = model if shared else engine_model(model, self.device, self.compute_dtype)
        self._update = WeightUpdater(weight_targets(self.model))
        self.eos_token_ids = list(eos_token_ids)
        mc = self.model.config
        kv_dtype = self.compute_dtype
        self.page_bytes = KVCache.bytes_per_page(
            mc.num_hidden_layers, c.page_size, mc.num_key_value_heads, mc.head_dim, kv_dtype
        )
        self.num_pages = self._pool_pages()
        self.cache = KVCache(
            num_layers=mc.num_hidden_layers,
            num_pages=self.num_pages,
            page_size=c.page_size,
            kv_heads=mc.num_key_value_heads,
            head_dim=mc.head_dim,
            dtype=kv_dtype,
            device=self.device,
        )
        self.runner = Runner(
            self.model,
            self.cache,
            compute_dtype=self.compute_dtype,
            max_batch=c.max_batch_sequences,
            max_context=c.max_context_tokens,
            cuda_graphs=c.cuda_graphs,
            compile_layers=c.compile_layers,
        )
        self.asleep = False
        self.stats: dict[str, float] = {}

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
        if awake:
            self.wake()

    def _pool_pages(self) -> int:
        c = self.config
        per_seq = -(-c.max_context_tokens // c.page_size)
        if c.kv_cache_tokens is not None:
            pages = -(-c.kv_cache_tokens // c.page_size)
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            pages = int(free * c.gpu_memory_utilization) // self.page_bytes
            # never more than the running sequences can hold at full context: a larger pool costs
            # memory, and time at every wake (allocation), for pages no sequence is ever given
            pages = min(pages, per_seq * c.max_batch_sequences)
        else:
            pages = per_seq * c.max_batch_sequences
        if pages < per_seq + 1:
            raise UserError(
                f"engine KV cache of {pages} pages ({c.page_size} tokens each) cannot hold one sequence of "
                f"max_context_tokens={c.max_context_tokens}; raise the cache size or lower the context"
            )
        return pages + 1  # page 0 is reserved

    # ----------------------------------------------------------------------------------- public
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[Generation]:
        """n generations per prompt, prompt-major: outputs[i * n + j] is sample j of prompt i."""
        if self.asleep:
            raise RuntimeError("the engine is asleep; call wake() first")
        c = self.config
        for i, prompt in enumerate(prompt_token_ids):
            if not prompt or len(prompt) >= c.max_context_tokens:
                raise UserError(
                    f"prompt {i} has {len(prompt)} tokens; the engine takes 1 to "
                    f"{c.max_context_tokens - 1} (max_context_tokens={c.max_context_tokens})"
                )
        total = len(prompt_token_ids) * params.n
        base = params.seed if params.seed is not None else int(torch.randint(0, 2**31 - 1, ()))
        first = params.first_sequence
        seeds = step_keys(
            torch.full((total,), base, dtype=torch.int64), torch.arange(first, first + total)
        ).tolist()
        scheduler = Scheduler(
            self.cache,
            max_sequences=c.max_batch_sequences,
            max_prefill_tokens=c.max_prefill_tokens,
            max_pages_per_sequence=self.runner.max_pages,
        )
        seqs: list[Sequence] = []
        for i, prompt in enumerate(prompt_token_ids):
            group = [
                Sequence(len(seqs) + j, i, list(prompt), len(prompt), seeds[len(seqs) + j])
                for j in range(params.n)
            ]
            seqs += group
            for k in range(0, params.n, c.max_batch_sequences):  # a job never outgrows the batch
                scheduler.add(PrefillJob(group[k : k + c.max_batch_sequences]))
        stops = torch.tensor(sorted(set(self.eos_token_ids) | set(params.stop_token_ids)), dtype=torch.int64)
        stops = stops.to(self.device)  # once per generate, not once per run
        start, steps = time.perf_counter(), 0
        finished = bar(total, "generate", enabled=c.progress, inner=True)
        while scheduler.has_work:
            jobs = scheduler.schedule_prefill()
            if jobs:
                finished.update(self._prefill(jobs, params, stops, scheduler))
            else:
                finished.update(self._decode(scheduler, params, stops))
            steps += 1
        finished.close()
        assert self.cache.pool.num_free == self.cache.pool.num_pages, "pages leaked"
        seconds = time.perf_counter() - start
        new_tokens = sum(s.num_generated for s in seqs)
        self.stats = {
            "steps": steps,
            "preemptions": scheduler.preemptions,
            "tokens": new_tokens,
            "seconds": seconds,
        }
        return [
            Generation(
                s.prompt_index, s.tokens[s.prompt_len :], s.logprobs, s.finish_reason, s.unscaled_logprobs
            )
            for s in seqs
        ]

    def _prefill(self, jobs: list[PrefillJob], params, stops, scheduler: Scheduler) -> int:
        """Prefill the jobs' prompts and sample every sequence's next token (returns those finished)."""
        logits = self.runner.prefill(jobs)  # [J, V]
        batch = [s for job in jobs for s in job.seqs]
        rows = torch.tensor([j for j, job in enumerate(jobs) for _ in job.seqs], device=logits.device)
        logits = logits.index_select(0, rows)  # the samples of a prompt share its logits
        for s in batch:
            s.cached = len(s.tokens)
        sampled = _Sampled(batch, params, stops, steps=1, device=logits.device)
        sampled.draw(logits, 0)
        return self._record(batch, sampled.fetch(), [1] * len(batch), params, scheduler)

    def _decode(self, scheduler: Scheduler, params, stops) -> int:
        """One run of up to `decode_steps` decode steps of every running sequence, recorded at its end
        (returns the sequences finished)."""
        c, ps, k = self.config, self.cache.page_size, self.config.decode_steps
        cap = params.max_tokens  # a sequence's token count never passes prompt + max_tokens or the context

        def wanted(s: Sequence) -> int:
            return min(k, min(s.prompt_len + cap, c.max_context_tokens) - len(s.tokens))

        batch = scheduler.schedule_decode(wanted)
        if not batch:
            raise RuntimeError("the engine cannot schedule any sequence (KV cache too small)")
        limits = [min(wanted(s), len(s.pages) * ps - s.cached) for s in batch]
        sampled = _Sampled(batch, params, stops, steps=max(limits), device=self.device)
        self.runner.decode(batch, scheduler.table[[s.row for s in batch]], limits, sampled.draw)
        return self._record(batch, sampled.fetch(), limits, params, scheduler)

    def _record(self, batch, run: np.ndarray, limits: list[int], params, scheduler: Scheduler) -> int:
        """Append each sequence's tokens of the run (run [steps, 4, B]: token, log-prob, unscaled
        log-prob, stop flag) up to its limit, its stop or its length; retire the finished sequences
        and return how many."""
        steps = run.shape[0]
        limit = np.array(limits)[:, None]  # [B, 1]
        k = np.arange(steps)[None, :]  # [1, steps]
        before = np.array([[s.num_generated, len(s.tokens)] for s in batch])  # [B, 2]
        length = (before[:, :1] + k + 1 >= params.max_tokens) | (
            before[:, 1:] + k + 1 >= self.config.max_context_tokens
        )  # [B, steps]: the token of step k reaches a limit
        stop = run[:, 3].T > 0  # [B, steps]
        ends = (stop | length) & (k < limit)
        ended = ends.any(1)  # [B]
        taken = np.where(ended, ends.argmax(1) + 1, limits)  # [B] tokens kept
        kept = (k < taken[:, None]).T  # [steps, B]
        if not (np.isfinite(run[:, 1]) & np.isfinite(run[:, 2]))[kept].all():
            raise NonFiniteLogits("the model produced NaN or inf logits during generation")
        # to Python lists once: per-sequence numpy slicing costs more than the rest of the loop
        tokens, logp = run[:, 0].T.astype(np.int64).tolist(), run[:, 1].T.tolist()  # [B][steps]
        unscaled, stopped = run[:, 2].T.tolist(), stop.tolist()
        for s, n, end, tok, lp, un, st in zip(
            batch, taken.tolist(), ended.tolist(), tokens, logp, unscaled, stopped
        ):
            s.tokens += tok[:n]
            s.logprobs += lp[:n]
            s.unscaled_logprobs += un[:n]
            if end:
                s.finish_reason = "stop" if st[n - 1] else "length"
                scheduler.finish(s)
            else:
                s.cached = len(s.tokens) - 1  # every token but the last is cached
        return int(ended.sum())

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy trainer tensors into the engine's weights in place (captured graphs stay valid);
        returns the bytes written (0 when the engine runs the trainer's own module)."""
        return self._update(named_tensors)

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        """The engine's weights under the trainer's parameter names (for the weight-sync check)."""
        return {name: tensors[0] for name, tensors in self._update.targets.items()}

    def sleep(self) -> None:
        """Free the KV pool and the captured graphs so that training gets the memory."""
        self.runner.drop_graphs()
        self.cache.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.asleep = True

    def wake(self) -> None:
        self.cache.allocate()
        self.asleep = False


class _Sampled:
    """Tokens drawn on the device during a run of steps, kept there until the run ends: one copy to
    the host per run instead of one per token."""

    def __init__(self, batch: list[Sequence], params: SamplingParams, stops: torch.Tensor, *, steps, device):
        self.params = params
        self.seeds = torch.tensor([s.seed for s in batch], dtype=torch.int64).to(device, non_blocking=True)
        generated = torch.tensor([s.num_generated for s in batch], dtype=torch.int64)
        self.generated = generated.to(device, non_blocking=True)  # [B] tokens before the run
        self.stops = stops  # [S] on the device
        self.out = torch.empty(steps, 4, len(batch), dtype=torch.float64, device=device)

    def draw(self, logits: torch.Tensor, k: int) -> torch.Tensor:
        """logits [B, V] of step k -> the sampled tokens [B] (recorded with their log-probs)."""
        tokens, logp, unscaled = sample(logits, self.params, self.seeds, self.generated + k)
        stopped = torch.isin(tokens, self.stops) if self.stops.numel() else torch.zeros_like(tokens)
        self.out[k] = torch.stack([tokens.double(), logp.double(), unscaled.double(), stopped.double()])
        return tokens

    def fetch(self) -> np.ndarray:
        """[steps, 4, B] on the host (the run's one sync)."""
        return self.out.cpu().numpy()
