"""Parallelism applied to our single-device model code from outside (DESIGN principle 7)."""

from hybridflow.parallel.collectives import data_parallel_scale, max_over_ranks, sum_over_ranks
from hybridflow.parallel.fsdp import apply_fsdp

__all__ = ["apply_fsdp", "data_parallel_scale", "max_over_ranks", "sum_over_ranks"]
