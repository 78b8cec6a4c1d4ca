"""The paged KV cache: one preallocated pool of pages per layer, and a page allocator with
reference counts so that the samples of one prompt share the prompt's pages."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from hybridflow.engine.config import EngineConfig
from hybridflow.errors import UserError


def pool_pages(config: EngineConfig, page_bytes: int, free_bytes: int | None) -> int:
    """Pages of a KV pool (page 0, reserved, not counted): kv_cache_tokens where set; else
    gpu_memory_utilization of `free_bytes` (the GPU's free memory; None off the GPU: room for every
    running sequence at full context), and never more than the running sequences can hold at full
    context (a larger pool costs memory, and time at every wake, for pages no sequence is given)."""
    c = config
    per_seq = -(-c.max_context_tokens // c.page_size)
    if c.kv_cache_tokens is not None:
        pages = -(-c.kv_cache_tokens // c.page_size)
    elif free_bytes is not None:
        pages = min(int(free_bytes * c.gpu_memory_utilization) // page_bytes, per_seq * c.max_batch_sequences)
    else:
        pages = per_seq * c.max_batch_sequences
    if pages < per_seq + 1:
        raise UserError(
            f"engine KV cache of {pages} pages ({c.page_size} tokens each) cannot hold one sequence of "
            f"max_context_tokens={c.max_context_tokens}; raise the cache size or lower the context"
        )
    return pages


class PagePool:
    """Host-side bookkeeping of physical pages: a free list and a reference count per page. Page 0 is
    never handed out: padded rows of a captured decode batch write their K/V there.

    The prefix cache: a full page whose K/V are known (`register`) keeps its key when its last user
    lets go; it then waits, least recently released first, to be found again by a request with the
    same prefix (`lookup`) or to be taken for new pages once the free list is empty. Such pages count
    as free."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages - 1  # usable pages
        self.refs = [0] * num_pages
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low pages first
        self._page_of: dict[bytes, int] = {}  # prefix key -> page
        self._key_of: dict[int, bytes] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached pages no sequence holds, LRU first

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._idle)

    @property
    def num_cached(self) -> int:
        return len(self._key_of)

    def allocate(self) -> int:
        if self._free:
            page = self._free.pop()
        else:  # evict the cached page released longest ago
            page, _ = self._idle.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
        self.refs[page] = 1
        return page

    def share(self, page: int) -> None:
        if self.refs[page] == 0:
            del self._idle[page]
        self.refs[page] += 1

    def release(self, pages: list[int]) -> None:
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if page in self._key_of:
                    self._idle[page] = None
                else:
                    self._free.append(page)
            assert self.refs[page] >= 0, f"page {page} released twice"

    def register(self, pages: list[int], keys: list[bytes]) -> None:
        """These full pages hold the K/V their keys name (a page already known, or a key already
        held by another page, is left as it is)."""
        for page, key in zip(pages, keys):
            if page not in self._key_of and key not in self._page_of:
                self._page_of[key], self._key_of[page] = page, key

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The cached pages of the longest prefix of `keys`, each now held once more (share)."""
        found = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            self.share(page)
            found.append(page)
        return found

    def forget_prefixes(self) -> None:
        """Every key dropped (the weights changed, or the K/V tensors are gone): idle pages are free."""
        self._free.extend(reversed(self._idle))
        self._idle.clear()
        self._page_of.clear()
        self._key_of.clear()


class KVCache:
    """K and V of every layer in one tensor each: [layers, pages * page_size, kv_heads, head_dim].
    A token's slot is page * page_size + offset. `release()` drops the tensors (sleep) and
    `allocate()` makes them again (wake); the page table lives in the sequences.

    With `routes` = (MoE layers, k), the experts each cached token went to in each MoE layer are kept
    beside its K/V, [MoE layers, slots, k] int16 (router replay): a prefix shared by a prompt's
    samples, or found in the prefix cache, keeps the routes computed with its K/V."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        routes: tuple[int, int] | None = None,
    ) -> None:
        self.shape = (num_layers, num_pages * page_size, kv_heads, head_dim)
        self.num_pages, self.page_size = num_pages, page_size
        self.dtype, self.device = dtype, device
        self.routes_shape = routes
        self.pool = PagePool(num_pages)
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.routes: torch.Tensor | None = None
        self.allocate()

    @staticmethod
    def bytes_per_page(
        num_layers: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype,
        routes: tuple[int, int] | None = None,
    ) -> int:
        kv = 2 * num_layers * page_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        return kv + (2 * routes[0] * routes[1] * page_size if routes else 0)  # int16 experts

    def allocate(self) -> None:
        if self.k is None:
            self.k = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
            self.v = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
            if self.routes_shape is not None:
                layers, k = self.routes_shape
                self.routes = torch.full(
                    (layers, self.shape[1], k), -1, dtype=torch.int16, device=self.device
                )

    def resize(self, num_pages: int) -> None:
        """A pool of `num_pages` pages instead (released: no sequence holds a page)."""
        if self.k is not None:
            raise RuntimeError("release the KV cache before resizing it")
        self.shape = (self.shape[0], num_pages * self.page_size, *self.shape[2:])
        self.num_pages, self.pool = num_pages, PagePool(num_pages)

    def release(self) -> None:
        if self.pool.num_free != self.pool.num_pages:
            raise RuntimeError("cannot free the KV cache while sequences hold pages")
        self.pool.forget_prefixes()  # the K/V they name go with the tensors
        self.k = self.v = self.routes = None

    def copy_page(self, src: int, dst: int) -> None:
        """Copy-on-write: a sequence about to write into a shared page gets its own copy."""
        s, d, n = src * self.page_size, dst * self.page_size, self.page_size
        self.k[:, d : d + n] = self.k[:, s : s + n]
        self.v[:, d : d + n] = self.v[:, s : s + n]
        if self.routes is not None:
            self.routes[:, d : d + n] = self.routes[:, s : s + n]

    def read_routes(self, sequences: list[tuple[list[int], int]]) -> list[torch.Tensor]:
        """The kept experts of each (pages, tokens) sequence's first `tokens` tokens: [tokens, MoE
        layers, k] int16 on the host each, read in one copy."""
        offsets = np.arange(self.page_size)
        slots = [(np.array(pages)[:, None] * self.page_size + offsets).ravel()[:n] for pages, n in sequences]
        flat = torch.from_numpy(np.concatenate(slots).astype(np.int64)).to(self.device)
        every = self.routes.index_select(1, flat).permute(1, 0, 2).cpu()  # [sum tokens, L, k]
        return list(torch.split(every, [n for _, n in sequences]))
