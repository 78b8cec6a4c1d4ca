"""Prefill and decode steps of our model over the paged KV cache; decode steps replay CUDA graphs
captured at bucketed batch sizes. The layers are the trainer's own modules (`before_attention` /
`after_attention`), or on CUDA the fused layers (fused_decode.py) that round as they do, or on CPU
in fp32 the same modules with their matmuls on oneDNN-packed weights (cpu_layers.py), so rollout and
trainer compute the same numbers."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext

import numpy as np
import torch

from hybridflow.batch import pack_sequences
from hybridflow.engine.attention import (
    paged_decode_attention,
    prefill_attention,
    prefix_prefill_attention,
    store_kv,
)
from hybridflow.engine.cpu_layers import OneDNNLayers
from hybridflow.engine.cpu_layers import supports as cpu_layers_supported
from hybridflow.engine.fused_decode import FusedDecode
from hybridflow.engine.kv_cache import KVCache
from hybridflow.engine.sampled import SampledRun, exact_logprobs
from hybridflow.engine.sequence import PrefillJob, Sequence
from hybridflow.models.native.model import NativeCausalLM, PackedLayout, project
from hybridflow.models.native.rope import rope_cos_sin


def graph_buckets(max_batch: int) -> list[int]:
    """Batch sizes with a decode graph: powers of two to 64, then every 64 up to max_batch (a batch
    runs in the smallest bucket that holds it; padding is at most 63 rows)."""
    small = [b for b in (1, 2, 4, 8, 16, 32, 64) if b < max_batch]
    return sorted(set(small + list(range(128, max_batch, 64)) + [max_batch]))


class Runner:
    def __init__(
        self,
        model: NativeCausalLM,
        cache: KVCache,
        *,
        compute_dtype: torch.dtype,
        max_batch: int,
        max_context: int,
        cuda_graphs: bool,
        compile_layers: bool = False,
        fused_decode: bool = False,
        onednn_layers: bool = False,
        decode_steps: int = 8,
        exact: bool = False,
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
        check_capture: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    ) -> None:
        """head: hidden [N, H] -> logits [N, V] where the model's own LM head does not give them whole
        (a tensor-parallel copy). check_capture(eager, replayed): told the logits of a decode graph's
        warm-up and of its first replay on the same inputs (a tensor-parallel copy: raises on every rank
        when a collective did not make it into the graph). exact: the model's own layers on the
        batch-invariant kernels (model.use_exact_kernels), attention over the pages in every step."""
        self.model, self.cache, self.page_size = model, cache, cache.page_size
        self.exact = exact
        if exact:  # the trainer's layers, rounded as it rounds them: nothing fused or compiled
            if not model.exact_kernels:
                model.use_exact_kernels()
            compile_layers = fused_decode = onednn_layers = False
        self.head = head or model.lm_head
        self.check_capture = check_capture
        self.device = cache.device
        self.compute_dtype = compute_dtype
        self.max_batch = max_batch
        self.max_pages = -(-max_context // self.page_size)  # block-table width
        embed_dtype = model.model.embed_tokens.weight.dtype
        positions = torch.arange(self.max_pages * self.page_size, device=self.device)
        self.cos, self.sin = rope_cos_sin(model.config, positions, embed_dtype)  # [T, D], as the trainer
        self.use_graphs = cuda_graphs and self.device.type == "cuda"
        # compiled layers specialise a batch of one (a recompile, seconds): it runs padded to two
        self.buckets = [b for b in graph_buckets(max_batch) if b > 1 or not compile_layers or b == max_batch]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.static: dict = {}  # the graphs' input tensors (and "step_state": the whole steps')
        self._graph_pool = None
        # The parts of each layer around attention, compiled (the layer's own switch, dynamic in the
        # token count): eager they are ~30 small kernels a layer (norms, RoPE, SwiGLU, casts), most
        # of a decode step's GPU time at any batch
        if compile_layers:
            for layer in model.model.layers:
                if layer.compiled is None:  # a module shared with the trainer may be compiled already
                    layer.compile()
        self.layer_parts = [
            layer.compiled or (layer.before_attention, layer.after_attention) for layer in model.model.layers
        ]
        self.decode_steps = decode_steps
        self.fused = FusedDecode(model, cache, self.cos, self.sin, compute_dtype) if fused_decode else None
        self.step_graphs: dict[tuple, torch.cuda.CUDAGraph] = {}  # (rows, mode, exact temperature) -> graph
        self.capture_seconds = 0.0  # spent capturing graphs (warm-ups included), since made
        self.warmed_up: set[tuple] = set()  # graph keys whose kernels ran once before a capture
        self._eager_state: dict[str, torch.Tensor] = {}  # the last whole-step run's without graphs
        # on CPU in fp32: the same layers with their matmuls through oneDNN on packed weights
        self.cpu_layers = (
            OneDNNLayers(model)
            if onednn_layers
            and self.fused is None
            and cpu_layers_supported(model, self.device, compute_dtype)
            else None
        )

    def _autocast(self):
        if self.compute_dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attend, slots: torch.Tensor
    ) -> torch.Tensor:
        """input_ids, positions [N] -> final hidden states [N, H]; attend(layer, q, k, v) -> [N, Hq, D].
        slots [N]: each token's cache slot, where an MoE layer's experts for it are kept (routes); the
        exact kernels store each layer's K/V there in its rotary's launch (k is then None), the other
        layers' attend stores them."""
        cos, sin = self.cos[positions], self.sin[positions]  # [N, D]
        if self.cpu_layers is not None:
            return self.cpu_layers.hidden(input_ids, cos, sin, attend)
        backbone, kept = self.model.model, self.cache.routes
        x = backbone.embed_tokens(input_ids)  # [N, H]
        sparse = 0
        for i, (before_attention, after_attention) in enumerate(self.layer_parts):
            if self.exact:
                q, k, v = before_attention(x, cos, sin, (self.cache.k[i], self.cache.v[i], slots))
            else:
                q, k, v = before_attention(x, cos, sin)
            if kept is not None and backbone.layers[i].sparse:  # the router's choices, kept
                x, chosen = backbone.layers[i].after_attention_routed(x, attend(i, q, k, v))
                kept[sparse].index_copy_(0, slots, chosen.to(kept.dtype))
                sparse += 1
            else:
                x = after_attention(x, attend(i, q, k, v))
        return backbone.norm(x)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, V] in the compute dtype: the sampler reads them in float32, as the trainer does."""
        if self.exact:
            return project(self.model.lm_head, hidden, True)
        if self.cpu_layers is not None:
            return self.cpu_layers.logits(hidden)
        return self.head(hidden)

    def _slots(self, pages: list[int], start: int, end: int) -> list[int]:
        ps = self.page_size
        return [pages[i // ps] * ps + i % ps for i in range(start, end)]

    @torch.no_grad()
    def prefill(self, jobs: list[PrefillJob]) -> torch.Tensor:
        """K/V of every job's tokens into its pages; logits at each job's last token [J, V]. A job
        whose sequences start with `cached` tokens (the prefix cache) computes only the rest."""
        if self.exact or any(job.seqs[0].cached for job in jobs):
            return self.extend([(job.tokens, job.seqs[0].cached, job.seqs[0].pages) for job in jobs])
        packed = pack_sequences([job.tokens for job in jobs])
        slots = [s for job in jobs for s in self._slots(job.seqs[0].pages, 0, len(job.tokens))]
        dev = self.device
        slots_t = torch.tensor(slots, dtype=torch.int64, device=dev)
        bounds = packed.cu_seqlens.tolist()
        layout = PackedLayout(
            packed.cu_seqlens.to(dev), bounds, max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        )
        cache = self.cache
        ids, pos = packed.input_ids.to(dev), packed.position_ids.to(dev)
        last = torch.tensor(bounds[1:], device=dev) - 1
        if self.fused is not None:  # K/V stored by the fused layers; attention to the new tokens

            def attend_fused(i, q, k, v):
                return prefill_attention(q, k, v.reshape(k.shape), layout)

            hidden = self.fused.hidden(ids, pos, slots_t, attend_fused, rotated_k=True)
            return self.fused.logits(hidden.index_select(0, last))

        def attend(i, q, k, v):
            store_kv(cache.k[i], cache.v[i], slots_t, k, v)
            return prefill_attention(q, k, v, layout)

        with self._autocast():
            hidden = self._hidden(ids, pos, attend, slots_t)
            return self._logits(hidden.index_select(0, last))

    @torch.no_grad()
    def extend(
        self, feeds: list[tuple[list[int], int, list[int]]], *, every_position: bool = False
    ) -> torch.Tensor:
        """feeds: (tokens, start, pages) each, whose tokens[:start] have their K/V in `pages` already:
        the new tokens[start:] are stored there and attend to the whole context, read back from the
        pages -> logits [F, V] at each feed's last token, or [new tokens, V] at every new token
        (`every_position`: a speculative step's verification). A prefix-cache hit's prefill, and every
        prefill of the exact kernels."""
        dev, cache = self.device, self.cache
        starts = [start for _, start, _ in feeds]
        ids = [t for tokens, a, _ in feeds for t in tokens[a:]]
        pos = [p for tokens, a, _ in feeds for p in range(a, len(tokens))]
        new = [s for tokens, a, pages in feeds for s in self._slots(pages, a, len(tokens))]
        every = [s for tokens, _, pages in feeds for s in self._slots(pages, 0, len(tokens))]
        q_bounds, k_bounds = [0], [0]
        for tokens, a, _ in feeds:
            q_bounds.append(q_bounds[-1] + len(tokens) - a)
            k_bounds.append(k_bounds[-1] + len(tokens))
        new_t = torch.tensor(new, dtype=torch.int64, device=dev)
        every_t = torch.tensor(every, dtype=torch.int64, device=dev)
        cu = (
            torch.tensor(q_bounds, dtype=torch.int32, device=dev),
            torch.tensor(k_bounds, dtype=torch.int32, device=dev),
        )

        if self.exact:  # the batch-invariant kernel reads the pages itself, as in a decode step
            from hybridflow.kernels.attention import paged_attention

            table, tiles = self._exact_pages([pages for _, _, pages in feeds], starts, q_bounds)

            def read_back(i, q):
                return paged_attention(q, cache.k[i], cache.v[i], table, self.page_size, tiles)

        else:

            def read_back(i, q):  # the whole context's K/V, the new tokens' just stored
                k_all, v_all = cache.k[i].index_select(0, every_t), cache.v[i].index_select(0, every_t)
                return prefix_prefill_attention(
                    q, k_all.to(q.dtype), v_all.to(q.dtype), q_bounds, k_bounds, cu
                )

        def attend(i, q, k, v):
            if not self.exact:  # (the exact layers stored them in their rotary's launch)
                store_kv(cache.k[i], cache.v[i], new_t, k, v)
            return read_back(i, q)

        ids_t, pos_t = torch.tensor(ids, device=dev), torch.tensor(pos, device=dev)
        if self.fused is not None:
            hidden = self.fused.hidden(ids_t, pos_t, new_t, lambda i, q, k, v: read_back(i, q))
        else:
            with self._autocast():
                hidden = self._hidden(ids_t, pos_t, attend, new_t)
        hidden = hidden.index_select(0, torch.tensor(q_bounds[1:], device=dev) - 1)
        if self.fused is not None:
            return self.fused.logits(hidden)
        with self._autocast():
            return self._logits(hidden)

    def _exact_pages(self, pages: list[list[int]], starts: list[int], q_bounds: list[int]):
        """The feeds' page table [F, pages] int32 and the exact kernel's tiles over their new tokens."""
        from hybridflow.kernels.attention import Tiles

        width = max(len(p) for p in pages)
        table = np.zeros((len(pages), width), dtype=np.int32)
        for j, p in enumerate(pages):
            table[j, : len(p)] = p
        counts = [b - a for a, b in zip(q_bounds[:-1], q_bounds[1:])]
        c = self.model.config
        tiles = Tiles.of_runs(
            starts, q_bounds[:-1], counts, c.num_attention_heads // c.num_key_value_heads, self.device
        )
        return torch.from_numpy(table).to(self.device, non_blocking=True), tiles

    def _decode_inputs(
        self, tokens: list[int], positions: list[int], table: np.ndarray, rows: int, limits: list[int]
    ) -> dict[str, torch.Tensor]:
        """Host tensors of a run of decode steps, padded to `rows` (padded rows: token 0 at position 0,
        limit 0: they write to the never-allocated page 0 and have no context). `table` holds the
        rows' page-table rows [B, max_pages]."""
        b = len(tokens)
        ids = np.zeros(rows, dtype=np.int64)
        pos = np.zeros(rows, dtype=np.int64)
        limit = np.zeros(rows, dtype=np.int64)
        padded = np.zeros((rows, self.max_pages), dtype=np.int32)
        ids[:b] = tokens
        pos[:b] = positions
        limit[:b] = limits
        padded[:b] = table
        host = {"ids": ids, "pos": pos, "limit": limit, "table": padded}
        return {k: torch.from_numpy(v) for k, v in host.items()}

    def _decode_step(self, ids, pos, slots, ctx, table) -> torch.Tensor:
        if self.fused is not None:
            return self.fused.forward(ids, pos, slots, ctx, table)
        cache, ps = self.cache, self.page_size
        if self.exact:  # one query a tile; few tiles: each key chunk a program of its own (same bits)
            from hybridflow.kernels.attention import Tiles, paged_attention

            tiles, split = Tiles.of_decode(ctx), ctx.shape[0] * cache.k[0].shape[1] <= 128

        def attend(i, q, k, v):
            if self.exact:  # (K/V stored in the layer's rotary launch)
                return paged_attention(q, cache.k[i], cache.v[i], table, ps, tiles, split=split)
            store_kv(cache.k[i], cache.v[i], slots, k, v)
            return paged_decode_attention(q, cache.k[i], cache.v[i], table, ctx, ps)

        with self._autocast():
            return self._logits(self._hidden(ids, pos, attend, slots))

    @torch.no_grad()
    def decode(
        self, seqs: list[Sequence], table: np.ndarray, limits: list[int], sampled: SampledRun, feed=None,
        *, continued: bool = False,
    ) -> bool:  # fmt: skip
        """Up to max(limits) decode steps with no host sync between them. Step k feeds each sequence's
        last token, caches its K/V and draws the next (`sampled` records the draws on the device).
        feed: (tokens, positions), a row each, instead of each sequence's last token at `cached`: a
        speculative step's one step, whose rows are a sequence's last token and its drafted ones (each
        row attends over its sequence's pages to its own position; all rows store their K/V in a layer
        before any attends, so a row sees the rows before it).
        Sequence i takes limits[i] steps (the cache slots reserved for it); after that its row still
        computes, but writes to the scratch page 0 and stays in place, and its results are to be
        ignored. table [B, max_pages]: the sequences' page-table rows.
        Returns whether the run's steps ran whole on the device (one graph a step, the draw recorded
        and fed back there): a next run of the same sequences may then go on from the device's state
        (`continued`: their input tokens and positions are those the last run left, not the host's),
        launched before this one's record is read.

        With the fused step or the exact kernels, and a sampler that runs on the device (one sampling
        group, no top-k / top-p), a step is prepare, forward, draw and record in one graph (`_step`): the
        run is `steps` replays. Otherwise the forward is a graph and the draw runs after it."""
        b, steps = len(seqs), max(limits)
        graphs = self.use_graphs and b <= self.max_batch
        # the fused step pads to the buckets with graphs or without, so the shapes (and the kernels'
        # summation orders) are the same either way
        padded = b <= self.max_batch and (graphs or self.fused is not None)
        rows = next(x for x in self.buckets if x >= b) if padded else b
        ids, pos = feed if feed is not None else ([s.tokens[-1] for s in seqs], [s.cached for s in seqs])
        host = self._decode_inputs(ids, pos, table, rows, limits)
        whole_steps = (self.fused is not None or self.exact) and steps <= self.decode_steps
        device_draw = sampled.device_draw() if whole_steps else None
        if device_draw is not None:
            self._decode_on_device(b, rows, steps, host, sampled, device_draw, graphs, continued)
            return True
        if continued:
            raise RuntimeError("a decode run goes on from the device's state only after a whole-step run")
        if graphs:
            if rows not in self.graphs:
                self._capture(rows)
            state = {k: self.static[k][:rows] for k in ("ids", "pos", "slots", "ctx", "table")}
            for name in ("ids", "pos", "table"):
                state[name].copy_(host[name], non_blocking=True)
        else:
            state = {k: host[k].to(self.device, non_blocking=True) for k in ("ids", "pos", "table")}
        limit = host["limit"].to(self.device, non_blocking=True)  # [rows]
        ids, pos, table_d = state["ids"], state["pos"], state["table"]
        ps = self.page_size
        row = torch.arange(rows, device=self.device)
        for k in range(steps):
            valid = limit > k  # [rows]
            slots = torch.where(valid, table_d[row, pos // ps].long() * ps + pos % ps, 0)
            ctx = torch.where(limit > 0, pos + 1, 0).int()
            if graphs:
                state["slots"].copy_(slots)
                state["ctx"].copy_(ctx)
                graph, logits = self.graphs[rows]
                graph.replay()
            else:
                logits = self._decode_step(ids, pos, slots, ctx, table_d)
            ids[:b] = sampled.draw(logits[:b], k)
            pos += valid
        return False

    def _decode_on_device(
        self, b, rows, steps, host, sampled: SampledRun, device_draw, graphs, continued
    ) -> None:
        mode, temperature, stops = device_draw
        # the exact record's log-probs come from the trainer's kernel at a scale fixed in the graph
        key = (rows, mode, temperature if self.exact else None)
        capacity = max(1024, 1 << (stops.numel() - 1).bit_length())  # stop ids the buffer holds
        if graphs:
            state = self._step_state(rows, capacity)
        else:  # (kept for a run that goes on from it)
            state = self._eager_state if continued else self._new_step_state(rows, capacity)
            self._eager_state = state
        for name in ("limit", "table") if continued else ("ids", "pos", "limit", "table"):
            state[name].copy_(host[name], non_blocking=True)
        for name, source in (("seeds", sampled.seeds), ("generated", sampled.generated)):
            state[name][:b].copy_(source)
            state[name][b:].zero_()
        state["step"].zero_()
        state["inv_t"].fill_(1.0 / temperature if temperature > 0 else 1.0)
        state["stops"].fill_(-1)
        state["stops"][: stops.numel()].copy_(stops)
        if graphs:
            if key not in self.step_graphs:
                self._capture_step(key, state)
            graph = self.step_graphs[key]
            for _ in range(steps):
                graph.replay()
        else:
            for _ in range(steps):
                self._step(state, mode, temperature)
        sampled.out = state["run"][:steps, :, :b]

    def _step(self, state: dict[str, torch.Tensor], mode: str, temperature: float) -> None:
        """One decode step from device state to device state: the rows' slots, contexts and noise keys
        from the step counter, the forward, the draw recorded and fed back. Exact: the record's
        log-probs are then the trainer's kernel's (exact_logprobs), as in the draw outside a graph."""
        from hybridflow.engine.triton_layer import prepare_step
        from hybridflow.engine.triton_sampler import sample_step_triton

        s = state
        prepare_step(
            s["step"], s["pos"], s["limit"], s["table"], s["seeds"], s["generated"], s["slots"],
            s["ctx"], s["keys"], self.page_size,
        )  # fmt: skip
        logits = self._decode_step(s["ids"], s["pos"], s["slots"], s["ctx"], s["table"])
        sample_step_triton(logits, mode, s["inv_t"], s["keys"], s)  # the drawn tokens are now s["ids"]
        if self.exact:
            logp, unscaled = exact_logprobs(logits, s["ids"], temperature)
            drawn = torch.stack([logp, unscaled]).double()[None]  # [1, 2, R]
            s["run"][:, 1:3].index_copy_(0, s["step"] - 1, drawn)  # this step's record (on the device)

    def _new_step_state(self, rows: int, capacity: int) -> dict[str, torch.Tensor]:
        """Device state of a run of whole steps (see _step)."""
        dev, i64 = self.device, torch.int64
        state = {name: torch.zeros(rows, dtype=i64, device=dev) for name in
                 ("ids", "pos", "limit", "seeds", "generated", "slots", "keys")}  # fmt: skip
        state["ctx"] = torch.zeros(rows, dtype=torch.int32, device=dev)
        state["table"] = torch.zeros(rows, self.max_pages, dtype=torch.int32, device=dev)
        state["step"] = torch.zeros(1, dtype=i64, device=dev)
        state["inv_t"] = torch.ones(1, dtype=torch.float32, device=dev)
        state["stops"] = torch.full((capacity,), -1, dtype=i64, device=dev)
        state["run"] = torch.zeros(self.decode_steps, 4, rows, dtype=torch.float64, device=dev)
        return state

    def _step_state(self, rows: int, capacity: int) -> dict[str, torch.Tensor]:
        """Views of the graphs' static step state for `rows` rows (grown to `capacity` stop ids)."""
        full = self.static.get("step_state")
        if full is None or full["stops"].numel() < capacity:
            if full is not None:  # captured graphs hold the old buffers' addresses: all go, with
                self.drop_graphs()  # their memory pool (a pool no graph holds cannot be reused)
            full = self._new_step_state(self.max_batch, capacity)
            self.static["step_state"] = full
        state = {k: v[:rows] for k, v in full.items() if k not in ("step", "inv_t", "stops", "run")}
        state.update(step=full["step"], inv_t=full["inv_t"], stops=full["stops"])
        state["run"] = full["run"].view(-1)[: self.decode_steps * 4 * rows].view(self.decode_steps, 4, rows)
        return state

    @torch.no_grad()
    def _capture_step(self, key: tuple, state: dict[str, torch.Tensor]) -> None:
        """Capture one whole decode step (warm-up first, the first time a key is captured: kernels
        compiled outside the capture; a capture again after a wake needs none). The warm-up runs on
        the state as set for the coming run: it writes only to the scratch page 0 (its limit check)
        and the record, which the run rewrites; its position advance is undone."""
        rows, mode, temperature = key
        start = time.perf_counter()
        if self.fused is not None:
            self.fused.forget_weights()
        saved = {k: state[k].clone() for k in ("ids", "pos", "step")}
        limit = state["limit"].clone()
        if ("step", key) not in self.warmed_up:
            state["limit"].zero_()  # the warm-up's rows have no step to take: slot 0, positions stay
            self._step(state, mode, temperature)
            torch.cuda.synchronize()
            self.warmed_up.add(("step", key))
        graph = torch.cuda.CUDAGraph()
        # thread_local: in an asynchronous run the trainer's thread uses the GPU during a capture
        with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
            self._step(state, mode, temperature)
        self._graph_pool = graph.pool()
        for k, v in saved.items():
            state[k].copy_(v)
        state["limit"].copy_(limit)
        self.step_graphs[key] = graph
        self.capture_seconds += time.perf_counter() - start

    @torch.no_grad()
    def _capture(self, bucket: int) -> None:
        """Capture the decode graph of one bucket, when a batch first needs it (after a wake the KV
        pool is new, so only the buckets in use are captured again). Graphs share one memory pool:
        they never run concurrently and each output is consumed before the next replay."""
        dev, n = self.device, self.max_batch
        start = time.perf_counter()
        if self.fused is not None:
            self.fused.forget_weights()
        names = ("ids", "pos", "slots", "ctx", "table")
        if "ids" not in self.static:  # (the whole-step graphs keep their state beside these)
            self.static.update(
                ids=torch.zeros(n, dtype=torch.int64, device=dev),
                pos=torch.zeros(n, dtype=torch.int64, device=dev),
                slots=torch.zeros(n, dtype=torch.int64, device=dev),
                ctx=torch.zeros(n, dtype=torch.int32, device=dev),
                table=torch.zeros(n, self.max_pages, dtype=torch.int32, device=dev),
            )
        for name in names:  # the warm-up below writes to the scratch page 0 only, never to a page
            self.static[name].zero_()  # that a live sequence owns
        args = [self.static[k][:bucket] for k in names]
        # warm-up: kernels compiled and autotuned outside the capture, the first time a bucket is
        # captured (a capture again after a wake needs none), and always for the TP check's comparison
        eager = None
        if self.check_capture is not None or ("forward", bucket) not in self.warmed_up:
            eager = self._decode_step(*args)
            torch.cuda.synchronize()
            self.warmed_up.add(("forward", bucket))
        graph = torch.cuda.CUDAGraph()
        # thread_local: in an asynchronous run the trainer's thread uses the GPU during a capture
        with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
            logits = self._decode_step(*args)
        self._graph_pool = graph.pool()
        if self.check_capture is not None:
            graph.replay()  # the warm-up's inputs again (it wrote only to the scratch page 0)
            self.check_capture(eager, logits)
        self.graphs[bucket] = (graph, logits)
        self.capture_seconds += time.perf_counter() - start

    def drop_graphs(self) -> None:
        if self.fused is not None:
            self.fused.forget_weights()
        self.graphs.clear()
        self.step_graphs.clear()
        self.static.clear()
        self._graph_pool = None
