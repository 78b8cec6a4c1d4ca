"""Run model-written Python in a sandbox: its own process, resource limits, no network, a private
scratch directory, a minimal environment, read-only everything else, and the run's files hidden.

Isolation uses Linux namespaces through util-linux (`unshare`, `mount`, `setpriv`): a new mount,
network and PID namespace (with its own /proc); every mount is remounted read-only, /dev/shm and the
directories named in `hide` are replaced by empty read-only tmpfs, and the program runs in a
size-limited tmpfs scratch directory, the only writable place. As root it then drops to the `nobody` user (so the
process-count limit applies); as a normal user the namespaces come from a user namespace instead.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

NOBODY = 65534
_INNER = r"""
set -e
mount --make-rprivate /
[ -d /dev/shm ] && mount -t tmpfs -o size=1k,mode=0555 tmpfs /dev/shm
for d in $HF_SANDBOX_HIDE; do [ -d "$d" ] && mount -t tmpfs -o size=1k,mode=0555 tmpfs "$d"; done
mount -t tmpfs -o size=${HF_SANDBOX_DISK},mode=1777 tmpfs "$HF_SANDBOX_WORK"
# every other mount read-only: the scratch tmpfs is the one writable place
awk '{print $5}' /proc/self/mountinfo | while read -r m; do
  case "$m" in /proc|/proc/*|/sys|/sys/*|/dev|/dev/pts|/dev/mqueue|"$HF_SANDBOX_WORK") ;;
    *) mount -o remount,bind,ro "$m" 2>/dev/null || true ;; esac
done
cd "$HF_SANDBOX_WORK"
exec $HF_SANDBOX_DROP "$HF_SANDBOX_PYTHON" -I -S "$HF_SANDBOX_PROGRAM"
"""


@dataclass
class SandboxLimits:
    wall_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 1024
    output_bytes: int = 1_000_000
    disk_mb: int = 16
    processes: int = 32


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int | None
    timed_out: bool
    output_truncated: bool

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.output_truncated


def _limits(limits: SandboxLimits) -> None:
    """preexec: resource limits inherited by everything the sandbox starts."""
    mem = limits.memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.output_bytes, limits.output_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if os.geteuid() != 0:  # as root the limit is applied after dropping to nobody (setpriv keeps it)
        used = len([p for p in os.listdir("/proc") if p.isdigit()])
        resource.setrlimit(resource.RLIMIT_NPROC, (used + limits.processes, used + limits.processes))
    else:
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))


def sandbox_python() -> str:
    """An interpreter the unprivileged sandbox user can execute: the system Python when there is one
    (model code needs only the standard library), else this process's own."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    return os.path.realpath(sys.executable)


def available() -> bool:
    return all(shutil.which(tool) for tool in ("unshare", "mount", "setpriv", "awk", "sh"))


def run_python(
    code: str,
    stdin: str = "",
    *,
    limits: SandboxLimits | None = None,
    hide: list[str] | tuple[str, ...] = (),
) -> SandboxResult:
    """Run `code` with `stdin`; returns its (truncated) output. Never raises for anything the code does."""
    limits = limits or SandboxLimits()
    if not available():
        raise RuntimeError(
            "the code sandbox needs util-linux (unshare, mount, setpriv): apt-get install util-linux"
        )
    base = Path(tempfile.mkdtemp(prefix="hybridflow-sandbox-", dir=os.environ.get("HYBRIDFLOW_SANDBOX_DIR")))
    try:
        work = base / "work"
        work.mkdir()
        (base / "program.py").write_text(code, encoding="utf-8")
        (base / "stdin.txt").write_text(stdin, encoding="utf-8")
        os.chmod(base, 0o755)
        os.chmod(base / "program.py", 0o644)
        root = os.geteuid() == 0
        env = {
            "PATH": "/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "HOME": str(work),
            "PYTHONDONTWRITEBYTECODE": "1",
            "HF_SANDBOX_WORK": str(work),
            "HF_SANDBOX_PROGRAM": str(base / "program.py"),
            "HF_SANDBOX_PYTHON": sandbox_python(),
            "HF_SANDBOX_DISK": f"{limits.disk_mb}m",
            "HF_SANDBOX_HIDE": " ".join(str(Path(h).resolve()) for h in hide),
            "HF_SANDBOX_DROP": f"setpriv --reuid={NOBODY} --regid={NOBODY} --clear-groups --no-new-privs"
            if root
            else "",
        }
        namespaces = ["--mount", "--net", "--pid", "--fork", "--kill-child", "--mount-proc"]
        command = [
            "unshare",
            *namespaces,
            *([] if root else ["--user", "--map-root-user"]),
            "sh",
            "-c",
            _INNER,
        ]
        with (
            open(base / "stdin.txt", "rb") as fin,
            open(base / "stdout.txt", "wb") as fout,
            open(base / "stderr.txt", "wb") as ferr,
        ):
            proc = subprocess.Popen(
                command, stdin=fin, stdout=fout, stderr=ferr, env=env, start_new_session=True,
                preexec_fn=lambda: _limits(limits),  # noqa: PLW1509 - limits must be set in the child
            )  # fmt: skip
            timed_out = False
            try:
                proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        out = (base / "stdout.txt").read_bytes()
        err = (base / "stderr.txt").read_bytes()
        truncated = len(out) >= limits.output_bytes or proc.returncode == -signal.SIGXFSZ
        return SandboxResult(
            stdout=out[: limits.output_bytes].decode("utf-8", "replace"),
            stderr=err[-4000:].decode("utf-8", "replace"),
            returncode=None if timed_out else proc.returncode,
            timed_out=timed_out,
            output_truncated=truncated,
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)
