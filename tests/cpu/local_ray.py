"""A local Ray cluster for the tests: 4 logical CPU slots (two groups of two workers) on whatever cores
the machine has, and one torch thread a worker.

The suite exports OMP_NUM_THREADS (conftest's `_fixed_threads`), which Ray workers would inherit in
place of the one thread a worker with `num_cpus=1` gets from Ray otherwise: two workers with two
threads each on a 2-core machine wait on each other's OpenMP barriers, every phase 3-4x slower."""

from hybridflow.controller.ray_worker_group import start_ray


def start_local_ray() -> None:
    start_ray(num_cpus=4, log_to_driver=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
