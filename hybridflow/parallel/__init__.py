"""Parallelism applied to our single-device model code from outside (DESIGN principle 7)."""

from hybridflow.parallel.fsdp import apply_fsdp, data_parallel_scale

__all__ = ["apply_fsdp", "data_parallel_scale"]
