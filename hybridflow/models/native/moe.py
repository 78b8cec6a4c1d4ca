"""Mixture-of-experts feed-forward blocks (Qwen3-MoE, Mixtral): a softmax router picks top-k experts
per token; each expert is a SwiGLU MLP. Weights under transformers' in-memory names and layouts, so
a model converts both ways by state dict: `mlp.gate.weight` [E, H], `mlp.experts.gate_up_proj`
[E, 2I, H], `mlp.experts.down_proj` [E, H, I].

Dispatch is grouped: the (token, choice) slots are sorted by expert, so each expert's tokens are one
contiguous block, and the weighted results are scattered back with one index_add. The blocks go
through one grouped GEMM (`torch.nn.functional.grouped_mm`) on CUDA in bf16: no host sync, so the
engine's decode steps can be captured in CUDA graphs; elsewhere (fp32, the CPU) a matmul per expert,
whose token counts the host reads. `record_routing` keeps the last forward's router logits and
choices: the load-balancing loss reads them. Router replay (R3): the engine records the experts each
token went to, and the trainer's forward routes the same tokens to the same experts (`routes`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    """Renormalise the chosen experts' probabilities to sum to 1 (Mixtral always; Qwen3-MoE by config)."""
    sparse_layers: tuple[int, ...]
    """The decoder layers whose feed-forward is this block (the others are dense MLPs)."""
    router_aux_loss_coef: float = 0.0


class Router(nn.Module):
    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))


class Experts(nn.Module):
    def __init__(self, hidden: int, intermediate: int, experts: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, intermediate))
        self.grouped_gemm: bool | None = None  # None: where it runs (grouped_gemm_dtype); True/False force it

    def forward(self, inputs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """inputs [S, H] in one block per expert, in expert order, counts [E] rows each -> each row
        through its expert's SwiGLU, [S, H]. Under expert parallelism (parallel/expert.py) the weights
        are this rank's experts and the blocks those sent to them."""
        gate_up, down = _local(self.gate_up_proj), _local(self.down_proj)  # [E, 2I, H], [E, H, I]
        dtype = grouped_gemm_dtype(inputs, gate_up, down) if self.grouped_gemm is None else None
        if self.grouped_gemm or dtype is not None:
            offs = counts.cumsum(0).to(torch.int32)  # [E] where each expert's block ends
            gate, up = _grouped(inputs, gate_up, offs, dtype).chunk(2, dim=-1)
            return _grouped(F.silu(gate) * up, down, offs, dtype).to(inputs.dtype)
        outputs = torch.empty_like(inputs)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                gate, up = F.linear(inputs[start : start + n], gate_up[e]).chunk(2, dim=-1)
                outputs[start : start + n] = F.linear(F.silu(gate) * up, down[e])
                start += n
        return outputs


@dataclass
class Routing:
    logits: torch.Tensor  # [N, E] the router's logits
    experts: torch.Tensor  # [N, k] the chosen experts


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, moe: MoEConfig) -> None:
        super().__init__()
        self.gate = Router(hidden, moe.num_experts)
        self.experts = Experts(hidden, moe.intermediate_size, moe.num_experts)
        self.top_k, self.norm_topk_prob, self.num_experts = moe.top_k, moe.norm_topk_prob, moe.num_experts
        self.record_routing = False
        self.routing: Routing | None = None

    def forward(self, x: torch.Tensor, routes: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, H] -> [N, H]. routes [N, k] int64 (router replay): a row of experts (>= 0) is used
        instead of the router's choice, the router's probabilities still weighting them (so the
        router trains); a row of -1 routes as the router chooses."""
        return self.mix(x, *self.route(x, routes))

    def route(self, x: torch.Tensor, routes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> each token's expert weights and experts, [N, k] each (`routes`: see forward)."""
        logits = F.linear(x, self.gate.weight)  # [N, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [N, k]
        if routes is not None:
            given = routes[:, :1] >= 0  # [N, 1]: a replayed row
            chosen = torch.where(given, routes, chosen)
            weights = torch.where(given, probs.gather(-1, chosen), weights)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.record_routing:
            self.routing = Routing(logits, chosen)
        return weights, chosen

    def mix(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """x [N, H], the tokens' expert weights and experts [N, k] -> the weighted experts' outputs [N, H]."""
        slots = chosen.flatten()  # [N*k] expert of each (token, choice)
        order = torch.argsort(slots, stable=True)  # slots grouped by expert
        tokens = order // self.top_k  # [N*k] the token each sorted slot reads
        # [E] slots per expert; scatter_add, unlike bincount, needs no host sync
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, slots, torch.ones_like(slots))
        outputs = self.experts(x.index_select(0, tokens), counts)  # [N*k, H]
        scaled = outputs * weights.flatten()[order, None].to(outputs.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, scaled)


def grouped_gemm_dtype(x: torch.Tensor, *weights: torch.Tensor) -> torch.dtype | None:
    """bfloat16 where the grouped GEMM runs: CUDA, bf16 compute (the tensors', or autocast's), rows
    whose strides are multiples of 16 bytes; None for the per-expert loop."""
    if not x.is_cuda or getattr(F, "grouped_mm", None) is None:
        return None
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
    aligned = all(w.shape[-1] % 8 == 0 and w.shape[-2] % 8 == 0 for w in weights)
    return torch.bfloat16 if dtype == torch.bfloat16 and aligned else None


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a weight that expert parallelism split (a DTensor), else the weight."""
    return weight.to_local() if hasattr(weight, "to_local") else weight


def _grouped(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, dtype) -> torch.Tensor:
    """x [S, K] in blocks ending at offs [E], weight [E, N, K] -> [S, N]: block e times weight[e]^T."""
    if dtype is not None:
        x, weight = x.to(dtype), weight.to(dtype)
    return F.grouped_mm(x, weight.transpose(-2, -1), offs=offs)


def load_balancing_loss(routings: list[Routing], num_experts: int, top_k: int) -> torch.Tensor:
    """The Switch Transformer auxiliary loss as transformers computes it over all MoE layers' tokens:
    E x sum_e (share of routing choices that went to e) x (mean router probability of e); 1 when
    the router is uniform and its choices balanced."""
    logits = torch.cat([r.logits for r in routings])  # [L*N, E]
    chosen = torch.cat([r.experts for r in routings])  # [L*N, k]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    share = F.one_hot(chosen, num_experts).float().mean(0)  # [k, E] per choice rank, as transformers
    return num_experts * (share * probs.mean(0)[None]).sum()
