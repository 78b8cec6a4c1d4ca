"""The engine over a tensor-parallel group (rollout.tensor_parallel_size): every rank of the group runs
the same engine on the same requests (SPMD), holding heads / tp of the attention, intermediate / tp
of the MLP, its rows of the vocabulary and KV pages of its KV heads only; the trainer's TP plan
(parallel/tensor.py) shards the copy, so two all-reduces a layer join the ranks' partial sums and the
logits are gathered whole before the sampler; on CUDA these collectives are captured in the decode
graphs with the rest of a step (each graph's first replay checked against its eager warm-up). The
sampler hashes its noise per sequence, so every rank draws the same tokens from the same logits; what
could still make ranks disagree (a random seed, a pool size from each GPU's free memory, a request
given to one rank only) is agreed here or caught at the next step, with one line, before the ranks'
collectives would wait on each other."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from hybridflow.models.native.model import NativeCausalLM
from hybridflow.parallel.tensor import TP_MESH, apply_tensor_parallel, full_logits

# the relative difference a decode graph's logits may have from the eager step's: summation order
# (NCCL may reduce in another order inside a graph); a rank's missing partial sums give ~1/tp and more
CAPTURE_TOLERANCE = 0.02


class EngineTP:
    def __init__(self, mesh: DeviceMesh) -> None:
        if mesh.mesh_dim_names != (TP_MESH,):
            raise ValueError(
                f"the engine's tensor parallelism runs over a 1-D mesh named {TP_MESH!r}, not {mesh}"
            )
        self.mesh, self.size, self.rank = mesh, mesh.size(), mesh.get_local_rank()
        self.group = mesh.get_group()
        self._device = torch.device(mesh.device_type)  # what the group's collectives take

    def shard(self, model: NativeCausalLM, compute_dtype: torch.dtype) -> NativeCausalLM:
        """The engine's copy, sharded in place (every rank holds the same whole copy before). The plan
        ties a tied head to the embedding's rows again (master dtype); the engine keeps its rows in the
        compute dtype, as a whole copy does, so no step casts them."""
        apply_tensor_parallel(model, self.mesh)
        head = model.lm_head.weight
        if head.dtype != compute_dtype:
            rows = head.to_local().to(compute_dtype)
            model.lm_head.weight = nn.Parameter(
                DTensor.from_local(rows, self.mesh, head.placements, shape=head.shape, stride=head.stride()),
                requires_grad=False,
            )
        return model

    def logits(self, model: NativeCausalLM) -> Callable[[torch.Tensor], torch.Tensor]:
        """hidden [N, H] -> the whole logits [N, V] on every rank (each computes its vocabulary rows)."""
        return partial(full_logits, model)

    def kv_heads(self, model: NativeCausalLM) -> int:
        return model.config.num_key_value_heads // self.size

    def _reduce(self, values: list, op, dtype: torch.dtype = torch.int64) -> list:
        t = torch.tensor(values, dtype=dtype, device=self._device)
        dist.all_reduce(t, op, group=self.group)
        return t.tolist()

    def fewest(self, pages: int) -> int:
        """The smallest of the ranks' KV pools: each sized its own from its GPU's free memory, and the
        scheduler must see one pool on every rank."""
        return self._reduce([pages], dist.ReduceOp.MIN)[0]

    def seed(self) -> int:
        """A random sampling seed, the first rank's on every rank (a request without a seed)."""
        mine = int(torch.randint(0, 2**31 - 1, ()))
        return self._reduce([mine if self.rank == 0 else 0], dist.ReduceOp.SUM)[0]

    def check_capture(self, eager: torch.Tensor, replayed: torch.Tensor) -> None:
        """A decode step's logits [B, V] run eagerly and replayed from the CUDA graph captured from it,
        on the same inputs: equal but for the collectives' summation order, unless a collective was
        left out of the graph (a rank's partial sums then reach the logits). Every rank learns the
        largest difference of the group, so all stop together."""
        scale = float(eager.float().norm())
        mine = float((replayed.float() - eager.float()).norm()) / max(scale, 1e-6)
        mine = min(mine, 1e6) if math.isfinite(mine) else 1e6  # a NaN would not win a MAX
        worst = self._reduce([mine], dist.ReduceOp.MAX, torch.float64)[0]
        if worst > CAPTURE_TOLERANCE:
            raise RuntimeError(
                f"tensor-parallel engine rank {self.rank}: a decode step replayed from its CUDA graph gave "
                f"other logits than the same step run eagerly (relative difference {worst:.3g}): a "
                "collective did not make it into the graph; set rollout.cuda_graphs=false"
            )

    def check_same_step(self, kind: str, seqs: list, prompts: list[list[int]] = ()) -> None:
        """Every rank is about to run the same prefill or decode of the same sequences at the same
        lengths, from the same tokens; else stop with one line (a rank would otherwise wait in a
        collective the others never join, join one of another shape, or compute its share of the
        logits from another prompt). A prefill compares its `prompts` whole (new there), a decode the
        token each sequence is fed (what it generated before is the same on every rank: the same
        logits drew it)."""
        rows = np.array([[s.seq_id, len(s.tokens), s.cached, s.tokens[-1]] for s in seqs], dtype=np.int64)
        signature = zlib.crc32(kind.encode() + rows.tobytes())
        for prompt in prompts:
            signature = zlib.crc32(np.array(prompt, dtype=np.int64).tobytes(), signature)
        low, high = self._reduce([-signature, signature], dist.ReduceOp.MAX)
        if -low != high:
            raise RuntimeError(
                f"tensor-parallel engine rank {self.rank}: the ranks are about to run different {kind} "
                f"steps ({len(seqs)} sequences here); every rank of the group must be given the same "
                "requests in the same order"
            )
