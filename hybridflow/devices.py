"""Device and dtype names from config and CLI, resolved in one place."""

from __future__ import annotations

import os
import time

import torch

from hybridflow.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """'auto' (cuda when present), 'cpu' or 'cuda'; asking for cuda without one is a clear error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("device 'cuda' was asked for but no CUDA device is available")
    return torch.device(name)


def seed_process(seed: int, *, deterministic: bool) -> None:
    """Every process of a run (the trainer's, each Ray worker's) starts here, before its first CUDA
    matmul: torch seeded, and with `deterministic` (trainer.deterministic) torch's deterministic
    algorithms where torch has them (scatter / index_add / cumsum kernels without atomics; a fixed cuBLAS
    workspace), warn-only: an op that has none (flash attention's backward among them) is named once in
    a warning and runs as before. New tensors are not filled first, which these algorithms do by
    default (a NaN fill a launch per allocation: ~680 more launches in a tiny exact model's forward and
    backward, ~260 in the ordinary path's): every kernel of a run writes the whole of its output, and
    one that read memory it had not written would have read those NaNs, which the exact runs that
    repeated with the fill on (H100) never did."""
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = False


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the GPU: a copy from pageable memory larger than
    the driver's staging buffer blocks the host until the stream drains, so CUDA copies go through
    pinned memory (PyTorch's pinned-block cache, kept until the copy has run)."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class FreeCores:
    """torch's CPU threads follow the cores that other processes leave free, measured again at most
    every `every_s` between two engine steps or training phases. A core shared with another busy
    process makes every one of torch's threads wait for the slowest at each barrier: on a 2-core
    machine a busy loop on one core made generation 5x slower with 2 threads, 1.03x with 1.
    Others' load is the system's busy CPU time less this process's own (its threads are not others).
    OMP_NUM_THREADS, when set, decides instead (and nothing moves)."""

    def __init__(self, every_s: float = 2.0) -> None:
        import psutil

        self.every_s = every_s
        self.fixed = bool(os.environ.get("OMP_NUM_THREADS"))
        self.cores = (
            len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        )
        self._process = psutil.Process()
        self._last = self._sample()

    def _sample(self) -> tuple[float, float, float]:
        import psutil

        system = psutil.cpu_times()
        own = self._process.cpu_times()
        # Linux counts guest time inside user and nice time as well: not twice here
        idle = system.idle + getattr(system, "iowait", 0.0)
        busy = sum(system) - idle - getattr(system, "guest", 0.0) - getattr(system, "guest_nice", 0.0)
        return time.monotonic(), busy, own.user + own.system

    def others_busy(self, since: tuple[float, float, float]) -> float:
        """Cores' worth of CPU other processes used since `since` (a sample)."""
        now = self._sample()
        wall = max(now[0] - since[0], 1e-6)
        return max(0.0, (now[1] - since[1]) - (now[2] - since[2])) / wall

    def adjust(self, *, force: bool = False) -> int | None:
        """Set torch's thread count to the free cores (a core counts as taken when others use more
        than 60% of one); the new count when it changed, else None."""
        if self.fixed or (not force and time.monotonic() - self._last[0] < self.every_s):
            return None
        taken = int(self.others_busy(self._last) + 0.4)  # 0.6 of a core or more: taken
        self._last = self._sample()
        threads = max(1, self.cores - taken)
        if threads == torch.get_num_threads():
            return None
        torch.set_num_threads(threads)
        return threads


_FREE_CORES: FreeCores | None = None


def follow_free_cores(*, start: bool = False) -> str | None:
    """Call between two pieces of CPU work: torch's threads follow the free cores (FreeCores). With
    `start`, others' load is first measured over a quarter second (this process sleeps meanwhile);
    returns a line saying what was chosen when it is fewer threads than cores."""
    global _FREE_CORES
    if _FREE_CORES is None:
        _FREE_CORES = FreeCores()
        start = True
    if start:
        if _FREE_CORES.fixed:
            return None
        time.sleep(0.25)
    _FREE_CORES.adjust(force=start)
    cores, count = _FREE_CORES.cores, torch.get_num_threads()
    if start and count < cores:
        return (
            f"{cores - count} of {cores} CPU cores are busy with other work: torch uses {count} thread(s), "
            "and follows the free cores as the run goes (set OMP_NUM_THREADS to fix the count)"
        )
    return None


def expandable_cuda_segments() -> None:
    """CUDA memory in segments that grow and shrink (PyTorch's expandable_segments), unless the user
    configured the allocator or CUDA has started: with an engine generating beside the trainer, two
    streams' caches fragment fixed segments until memory the plan counted on is reserved but unusable
    (7 GiB of 140 in a long-tail streaming run on the H200)."""
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and not torch.cuda.is_initialized():
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
