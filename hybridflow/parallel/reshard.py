"""Resharding in place: the trainer's FSDP2 (x TP) shards -> a colocated engine's TP shards, point to point.

Every rank holds one box of each parameter (its FSDP2 rows of its TP part) and needs one box of it in
the engine (its TP slice; all of a replicated norm). A plan made once from every rank's boxes says who
sends which part of each needed box; at a sync each rank sends, a unit (decoder layer) at a time, one
flat buffer per peer and dtype, in the engine's dtype, and receives exactly the parts of its slice
that it does not hold: no layer is gathered, and nothing beyond a rank's own slice and one unit's
messages is ever allocated (the 3D-HybridEngine's zero-redundancy resharding).

A box is ((start, stop) per dimension) in the whole tensor's coordinates."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

Box = tuple[tuple[int, int], ...]


def held_box(p: torch.Tensor) -> Box:
    """The part of the whole tensor this rank's local tensor is (a DTensor's; all of a plain one)."""
    if not isinstance(p, DTensor):
        return tuple((0, n) for n in p.shape)
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple((o, o + n) for o, n in zip(offset, shape, strict=True))


def _numel(box: Box) -> int:
    out = 1
    for start, stop in box:
        out *= max(0, stop - start)
    return out


def _inside(inner: Box, outer: Box) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (i0, i1), (o0, o1) in zip(inner, outer, strict=True))


def _cells(needed: Box, held: list[Box]) -> list[Box]:
    """`needed` cut at every edge of every held box inside it: each cell lies wholly inside or wholly
    outside each held box."""
    cuts = []
    for d, (lo, hi) in enumerate(needed):
        edges = {lo, hi} | {e for box in held for e in box[d] if lo < e < hi}
        edges = sorted(edges)
        cuts.append(list(itertools.pairwise(edges)))
    return [cell for cell in itertools.product(*cuts) if _numel(cell)]


def _view(local: torch.Tensor, box: Box, origin: Box) -> torch.Tensor:
    """The part `box` of a local tensor whose own box starts at `origin`."""
    return local[tuple(slice(b0 - o0, b1 - o0) for (b0, b1), (o0, _) in zip(box, origin, strict=True))]


@dataclass
class _Unit:
    names: list[str]
    sends: dict[int, list[tuple[str, Box]]] = field(default_factory=dict)  # peer -> parts, in order
    recvs: dict[int, list[tuple[str, Box]]] = field(default_factory=dict)
    own: list[tuple[str, Box]] = field(default_factory=list)  # parts of my slice that I hold


class ReshardPlan:
    """Made once on every rank of the default group (a collective: the ranks' boxes are exchanged)
    from the trainer's parameters (`sources`, sharded) and the engine's tensors (`targets`, by the
    trainer's names); `units` are lists of parameter names (a decoder layer each, then the rest)."""

    def __init__(self, sources: dict[str, torch.Tensor], targets: dict[str, torch.Tensor],
                 units: list[list[str]]) -> None:  # fmt: skip
        self.rank, world = dist.get_rank(), dist.get_world_size()
        self.targets = targets
        for name in sources:
            if name not in targets:
                raise KeyError(f"reshard: the engine's model has no parameter {name!r}")
        self._slice = {name: held_box(t) for name, t in targets.items()}  # this rank's engine box
        mine = {name: (held_box(sources[name]), self._slice[name]) for name in sources}
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine)
        sent = [0] * world  # elements each rank sends: a part held twice goes to the one that sent less
        self.units = []
        for names in units:
            unit = _Unit(names)
            for name in names:
                held = [everyone[r][name][0] for r in range(world)]
                for receiver in range(world):
                    for cell in _cells(everyone[receiver][name][1], held):
                        if _inside(cell, held[receiver]):
                            sender = receiver
                        else:
                            holders = [r for r in range(world) if _inside(cell, held[r])]
                            if not holders:
                                raise RuntimeError(f"reshard: no rank holds {cell} of {name!r}")
                            sender = min(holders, key=lambda r: (sent[r], r))
                            sent[sender] += _numel(cell)
                        if receiver == self.rank == sender:
                            unit.own.append((name, cell))
                        elif receiver == self.rank:
                            unit.recvs.setdefault(sender, []).append((name, cell))
                        elif sender == self.rank:
                            unit.sends.setdefault(receiver, []).append((name, cell))
            self.units.append(unit)

    def received_elements(self) -> int:
        """Elements this rank receives at a sync (the ideal: the parts of its slice it does not hold)."""
        return sum(_numel(box) for u in self.units for parts in u.recvs.values() for _, box in parts)

    def received_bytes(self) -> int:
        return sum(
            _numel(box) * self.targets[name].element_size()
            for u in self.units
            for parts in u.recvs.values()
            for name, box in parts
        )

    @torch.no_grad()
    def run(self, sources: dict[str, torch.Tensor]):
        """Yields, a unit at a time, (name, this rank's engine slice) pairs from the trainer's current
        parameters: a DTensor placed as the engine's tensor (its local part is the slice), or the whole
        tensor of an unsplit one. Every rank runs it (the exchange is a collective)."""
        for unit in self.units:
            yield self._exchange(unit, sources)

    def _exchange(self, unit: _Unit, sources: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        out, device = {}, _device(self.targets)
        for name in unit.names:
            target = self.targets[name]
            local = target.to_local() if isinstance(target, DTensor) else target
            out[name] = torch.empty_like(local)
        ops, inbox = [], []
        for peer in sorted(unit.sends.keys() | unit.recvs.keys()):
            for dtype in sorted({self.targets[n].dtype for n, _ in unit.sends.get(peer, [])}, key=str):
                parts = [p for p in unit.sends[peer] if self.targets[p[0]].dtype == dtype]
                flat = torch.cat(
                    [_part(sources[name], box, device).reshape(-1).to(dtype) for name, box in parts]
                )
                ops.append(dist.P2POp(dist.isend, flat, peer, tag=_tag(dtype)))
            for dtype in sorted({self.targets[n].dtype for n, _ in unit.recvs.get(peer, [])}, key=str):
                parts = [p for p in unit.recvs[peer] if self.targets[p[0]].dtype == dtype]
                flat = torch.empty(sum(_numel(b) for _, b in parts), dtype=dtype, device=device)
                ops.append(dist.P2POp(dist.irecv, flat, peer, tag=_tag(dtype)))
                inbox.append((flat, parts))
        for name, box in unit.own:
            _view(out[name], box, self._slice[name]).copy_(_part(sources[name], box, device))
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        for flat, parts in inbox:
            offset = 0
            for name, box in parts:
                dst = _view(out[name], box, self._slice[name])
                dst.copy_(flat[offset : offset + dst.numel()].view(dst.shape))
                offset += dst.numel()
        return [(name, placed(self.targets[name], out[name])) for name in unit.names]


def placed(target: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local`, an engine rank's slice, placed as the engine's `target` is (the whole tensor of an
    unsplit one), for Engine.update_weights."""
    if not isinstance(target, DTensor):
        return local
    return DTensor.from_local(local, target.device_mesh, target.placements, run_check=False,
                              shape=target.shape, stride=target.stride())  # fmt: skip


def part_of(whole: torch.Tensor, box: Box) -> torch.Tensor:
    """The part `box` of a whole tensor (a view)."""
    return whole[tuple(slice(start, stop) for start, stop in box)]


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def _part(source: torch.Tensor, box: Box, device: torch.device) -> torch.Tensor:
    """The part `box` of a trainer parameter (its box is taken now: an offloaded or unsharded one too)."""
    local = source.to_local() if isinstance(source, DTensor) else source
    return _view(local.detach(), box, held_box(source)).to(device)


def _tag(dtype: torch.dtype) -> int:
    return {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}.get(dtype, 4)


def _device(targets: dict[str, torch.Tensor]) -> torch.device:
    return next(iter(targets.values())).device
