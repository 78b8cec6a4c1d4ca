"""One cgroup per sandboxed program: memory and process count capped for the whole program (every
process it starts counts), and every process in it killed at once at the deadline.

cgroup v2 where the kernel offers the memory and pids controllers in a directory we may write
(as root, or a delegated subtree); else v1's memory and pids hierarchies (hybrid hosts, as root);
else None, and the sandbox falls back to per-process rlimits (docs/reliability.md says what that
cannot cap).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
SELF = Path("/proc/self/cgroup")


def _own_path(controller: str, self_cgroup: Path) -> str | None:
    """This process's cgroup in hierarchy `controller` ('' for v2) from /proc/self/cgroup."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, names, path = line.split(":", 2)
        if (controller == "" and names == "") or controller in names.split(","):
            return path
    return None


class ProgramCgroup:
    """`join_path`s are the cgroup.procs files a new process writes its PID to (before it execs)."""

    def __init__(self, version: int, dirs: list[Path]) -> None:
        self.version = version
        self.dirs = dirs

    @property
    def label(self) -> str:
        return f"cgroup v{self.version}"

    @property
    def join_paths(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    @classmethod
    def create(
        cls, memory_bytes: int, processes: int, *, root: Path = ROOT, self_cgroup: Path = SELF
    ) -> ProgramCgroup | None:
        """A new group under this process's own, or None where none can be made (`root` and
        `self_cgroup` are the cgroup filesystem and /proc/self/cgroup; tests give others)."""
        name = f"hybridflow-sandbox-{uuid.uuid4().hex[:12]}"
        for make in (cls._v2, cls._v1):
            try:
                group = make(name, memory_bytes, processes, root, self_cgroup)
            except OSError:
                group = None
            if group is not None:
                return group
        return None

    @classmethod
    def _v2(cls, name: str, memory_bytes: int, processes: int, root: Path, self_cgroup: Path):
        own = _own_path("", self_cgroup)
        if own is None or not (root / "cgroup.controllers").exists():
            return None
        parent = root / own.lstrip("/")
        if not {"memory", "pids"} <= set((parent / "cgroup.subtree_control").read_text().split()):
            return None  # the controllers are not delegated to our children (or live in v1)
        group = parent / name
        group.mkdir()
        try:
            (group / "memory.max").write_text(str(memory_bytes))
            (group / "memory.swap.max").write_text("0") if (group / "memory.swap.max").exists() else None
            (group / "pids.max").write_text(str(processes))
        except OSError:
            group.rmdir()
            raise
        return cls(2, [group])

    @classmethod
    def _v1(cls, name: str, memory_bytes: int, processes: int, root: Path, self_cgroup: Path):
        dirs = []
        try:
            for controller, limits in (
                (
                    "memory",
                    {"memory.limit_in_bytes": memory_bytes, "memory.memsw.limit_in_bytes": memory_bytes},
                ),
                ("pids", {"pids.max": processes}),
            ):
                own = _own_path(controller, self_cgroup)
                mount = root / controller
                if own is None or not (mount / "cgroup.procs").exists():
                    raise OSError(f"no v1 {controller} hierarchy")
                group = mount / own.lstrip("/") / name
                group.mkdir()
                dirs.append(group)
                for key, value in limits.items():  # swap accounting may be off: memsw alone is optional
                    if "memsw" not in key or (group / key).exists():
                        (group / key).write_text(str(value))
        except OSError:
            cls(1, dirs).remove()
            raise
        return cls(1, dirs)

    def pids(self) -> set[int]:
        found: set[int] = set()
        for d in self.dirs:
            with contextlib.suppress(OSError):
                found |= {int(p) for p in (d / "cgroup.procs").read_text().split()}
        return found

    def kill_all(self, timeout_s: float = 5.0) -> None:
        """SIGKILL every process in the group (v2: cgroup.kill), until none is left or the timeout."""
        deadline = time.monotonic() + timeout_s
        if self.version == 2 and (self.dirs[0] / "cgroup.kill").exists():
            with contextlib.suppress(OSError):
                (self.dirs[0] / "cgroup.kill").write_text("1")
        while (left := self.pids()) and time.monotonic() < deadline:
            for pid in left:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)

    def remove(self) -> None:
        for d in self.dirs:
            with contextlib.suppress(OSError):
                d.rmdir()
