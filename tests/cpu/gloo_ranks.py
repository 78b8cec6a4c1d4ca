"""A gloo process group for the tests that spawn ranks, torn down without racing the store's host.

Rank 0 hosts the TCPStore. Had it exited as soon as its own group was gone, a rank still inside
destroy_process_group could lose its peer's sockets and store mid-teardown (a rare SIGABRT, "terminate
called without an active exception", of a test that had passed). Here every rank reports its
teardown to the store, and rank 0 leaves only once all have: with a deadline, so a rank that died
does not hold the test (mp.spawn reports that rank's error). A rank whose body and teardown went
through then exits at once (os._exit), so that no destructor at the interpreter's exit can abort it.
Only spawned ranks use this."""

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist


@contextmanager
def gloo_group(rank: int, world: int, port: int, timeout_s: float = 300.0) -> Iterator[None]:
    """The default process group over `world` ranks for the body; a rank whose body fails skips the
    closing barrier (the others then fail at theirs, within `timeout_s`, rather than hang)."""
    # the ranks share this machine's cores: each with as many torch threads as cores would make every
    # thread of both wait for the slowest (OpenMP's barriers), several times slower on 2 cores
    torch.set_num_threads(max(1, torch.get_num_threads() // world))
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        yield
        dist.barrier()  # no rank tears down while another still works
    finally:
        dist.destroy_process_group()
        store.add("torn_down", 1)
        deadline = time.monotonic() + timeout_s
        while rank == 0 and store.add("torn_down", 0) < world and time.monotonic() < deadline:
            time.sleep(0.01)
    # the body and the teardown went through: the rank leaves now. At the interpreter's exit C++
    # destructors could still abort on a thread left joinable (the same SIGABRT, seen again on
    # 2026-12-05 in test_sharded_load after its ranks had torn down); mp.spawn reads exit code 0
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
