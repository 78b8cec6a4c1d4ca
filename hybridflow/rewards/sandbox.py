"""Run model-written Python in a sandbox; nothing it does is seen outside it, and it ends at the deadline.

Isolation uses Linux namespaces through util-linux (`unshare`, `mount`, `setpriv`): new mount, PID
(with its own /proc), network, IPC and UTS namespaces. Inside, the first process (root there: really
root, or a user namespace's root for an ordinary user) makes the mounts: every mount read-only, one
private size-limited tmpfs on /tmp (bound at /var/tmp and /dev/shm too, the only writable place),
and the directories and files named in `hide` (the run directory, the data files), /run and
/dev/mqueue replaced by empty read-only ones. Then `lockdown.py` loads the seccomp filter of
seccomp_filter.py (no mount, unshare, ptrace, keyctl, bpf, io_uring, Unix sockets, ...) and
`setpriv` drops every capability, the bounding set and (as root) the user, with no_new_privs; only
then does the program start.

Limits: a cgroup for the whole program (memory, process count; see cgroup.py) where one can be made,
rlimits per process always (CPU time, address space, file size, and the process count where no
cgroup caps it). The first process stays as the namespace's init: killing it (at the deadline, or
when the scorer that started it dies) kills every process in the namespace, `setsid()` or not.
The wall limit is the smaller of the sandbox's own and what is left of the reward's deadline.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hybridflow.rewards import deadline
from hybridflow.rewards.cgroup import ProgramCgroup
from hybridflow.rewards.seccomp_filter import filter_bpf

NOBODY = 65534
PR_SET_PDEATHSIG = 1
LOCKDOWN = Path(__file__).with_name("lockdown.py")
_INNER = r"""
set -e
mount --make-rprivate /
hostname sandbox
# one size-limited tmpfs is every writable place: /tmp (the scratch directory), /var/tmp, /dev/shm
mount -t tmpfs -o size=${HF_SANDBOX_DISK},mode=1777 tmpfs /tmp
mkdir -m 1777 /tmp/.var-tmp /tmp/.shm
[ -d /var/tmp ] && [ ! -L /var/tmp ] && mount --bind /tmp/.var-tmp /var/tmp
[ -d /dev/shm ] && [ ! -L /dev/shm ] && mount --bind /tmp/.shm /dev/shm
# one path a line (a name with spaces stays one path); the caller refuses names with a newline
printf '/run\n/var/run\n/dev/mqueue\n%s\n' "$HF_SANDBOX_HIDE" | while IFS= read -r d; do
  [ -n "$d" ] || continue
  if [ -d "$d" ] && [ ! -L "$d" ]; then mount -t tmpfs -o size=1k,mode=0555 tmpfs "$d"
  elif [ -f "$d" ]; then mount --bind /dev/null "$d"; fi
done
# every other mount read-only; mountinfo escapes a space in a mount point as \040 (octal)
mounts() { awk '{ m = $5; out = "";
  while (match(m, /\\[0-7][0-7][0-7]/)) {
    c = substr(m, RSTART + 1, 3); v = (substr(c, 1, 1) * 64) + (substr(c, 2, 1) * 8) + substr(c, 3, 1)
    out = out substr(m, 1, RSTART - 1) sprintf("%c", v); m = substr(m, RSTART + 4) }
  print $6 " " out m }' /proc/self/mountinfo; }
writable() { case "$1" in /proc|/proc/*|/dev|/dev/pts|/tmp|/var/tmp|/dev/shm) return 0;; esac; return 1; }
mounts | while IFS= read -r line; do
  m="${line#* }"; writable "$m" || mount -o remount,bind,ro "$m" 2>/dev/null || :
done
# fail closed: a mount that is still writable means no program runs (the kernel's own files under
# /sys are the host root's, which the program's user cannot write)
mounts | while IFS= read -r line; do
  options="${line%% *}"; m="${line#* }"
  case ",$options," in *,ro,*) continue;; esac
  case "$m" in /sys|/sys/*) continue;; esac
  writable "$m" && continue
  echo "sandbox: $m could not be made read-only; the program was not run" >&2; exit 125
done || exit 125
cd /tmp
set +e
# not exec'd: this shell stays the namespace's init, so killing it (or its parent dying) kills all.
# The program, lockdown.py and the seccomp filter come in on open file descriptors: /tmp is
# hidden now, and hybridflow's own environment may be too.
"$HF_SANDBOX_PYTHON" -I -S "$HF_SANDBOX_LOCKDOWN" "$HF_SANDBOX_FILTER" setpriv $HF_SANDBOX_DROP --inh-caps=-all \
  --bounding-set=-all --no-new-privs "$HF_SANDBOX_PYTHON" -I -S "$HF_SANDBOX_PROGRAM"
exit $?
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
    limited_by: str = "rlimits"
    """What capped the whole program's memory and processes: 'cgroup v2', 'cgroup v1' or 'rlimits'."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.output_truncated


def hidden_paths(hide) -> list[str]:
    """What the program must not see: `hide`, and for an ordinary user the home directory (its
    ~/.netrc, ~/.ssh, tokens and data copies). Where the interpreter lives in the home, the home's
    other entries instead. A name with a newline is refused (the inner shell reads one a line)."""
    paths = [Path(h).resolve() for h in hide]
    home = Path(os.path.expanduser("~")).resolve()
    if os.geteuid() != 0 and home != Path("/") and home.is_dir():
        python = Path(sandbox_python()).resolve()
        if home in python.parents:
            paths += [e for e in home.iterdir() if not (e == python or e in python.parents)]
        else:
            paths.append(home)
    for p in paths:
        if "\n" in str(p):
            raise ValueError(f"cannot hide {str(p)!r} in the sandbox: its name holds a newline")
    return [str(p) for p in paths]


def user_tasks() -> int:
    """Processes and threads of this user now: what RLIMIT_NPROC counts (its threads too)."""
    uid, count = os.getuid(), 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.stat(f"/proc/{pid}").st_uid == uid:
                count += len(os.listdir(f"/proc/{pid}/task"))
    return count


def _child_setup(limits: SandboxLimits, cgroup_procs: list[str], used: int) -> None:
    """preexec: die with the scorer, join the program's cgroup, set the limits everything inherits.
    `used`: this user's tasks when the program starts (an ordinary user's limit counts them all)."""
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    for path in cgroup_procs:
        with open(path, "w") as f:
            f.write(str(os.getpid()))
    mem = limits.memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.output_bytes, limits.output_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if os.geteuid() != 0:  # counts all this user's processes and threads: leave room for those running now
        resource.setrlimit(resource.RLIMIT_NPROC, (used + limits.processes, used + limits.processes))
    elif not cgroup_procs:  # as root the limit applies once setpriv has made the program `nobody`
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))


def sandbox_python() -> str:
    """An interpreter the unprivileged sandbox user can execute: the system Python when there is one
    (model code needs only the standard library), else this process's own."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    return os.path.realpath(sys.executable)


def available() -> bool:
    try:
        filter_bpf()  # pyseccomp and libseccomp are here
    except (ImportError, RuntimeError, OSError):
        return False
    return all(shutil.which(tool) for tool in ("unshare", "mount", "setpriv", "awk", "sh", "hostname"))


def _kill(proc: subprocess.Popen, cgroup: ProgramCgroup | None) -> None:
    """The namespace's init and unshare are one process group: SIGKILL to it ends the namespace."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if cgroup is not None:
        cgroup.kill_all()


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
            "the code sandbox needs util-linux (unshare, mount, setpriv) and libseccomp with pyseccomp: "
            "apt-get install util-linux libseccomp2 && pip install pyseccomp"
        )
    wall_s = min(limits.wall_s, deadline.remaining_s())
    if wall_s <= 0:
        return SandboxResult("", "the reward's deadline had passed", None, True, False)
    base = Path(tempfile.mkdtemp(prefix="hybridflow-sandbox-", dir=os.environ.get("HYBRIDFLOW_SANDBOX_DIR")))
    cgroup = ProgramCgroup.create(limits.memory_mb * 2**20, limits.processes)  # None where none can be made
    proc = None
    try:
        (base / "program.py").write_text(code, encoding="utf-8")
        (base / "stdin.txt").write_text(stdin, encoding="utf-8")
        (base / "filter.bpf").write_bytes(filter_bpf())
        os.chmod(base, 0o755)
        os.chmod(base / "program.py", 0o644)
        with (
            open(base / "program.py", "rb") as program,
            open(LOCKDOWN, "rb") as lockdown,
            open(base / "filter.bpf", "rb") as seccomp_filter,
            open(base / "stdin.txt", "rb") as fin,
            open(base / "stdout.txt", "wb") as fout,
            open(base / "stderr.txt", "wb") as ferr,
        ):
            root = os.geteuid() == 0
            used = 0 if root else user_tasks()
            env = {
                "PATH": "/usr/bin:/bin:/usr/sbin:/sbin",
                "LANG": "C.UTF-8",
                "HOME": "/tmp",
                "PYTHONDONTWRITEBYTECODE": "1",
                "HF_SANDBOX_PYTHON": sandbox_python(),
                "HF_SANDBOX_LOCKDOWN": f"/dev/fd/{lockdown.fileno()}",
                "HF_SANDBOX_FILTER": f"/dev/fd/{seccomp_filter.fileno()}",
                "HF_SANDBOX_PROGRAM": f"/dev/fd/{program.fileno()}",
                "HF_SANDBOX_DISK": f"{limits.disk_mb}m",
                "HF_SANDBOX_HIDE": "\n".join(hidden_paths(hide)),
                "HF_SANDBOX_DROP": f"--reuid={NOBODY} --regid={NOBODY} --clear-groups" if root else "",
            }
            namespaces = [
                "--mount",
                "--net",
                "--pid",
                "--ipc",
                "--uts",
                "--fork",
                "--kill-child",
                "--mount-proc",
            ]
            command = [
                "unshare",
                *namespaces,
                *([] if root else ["--user", "--map-root-user"]),
                "sh",
                "-c",
                _INNER,
            ]
            proc = subprocess.Popen(
                command, stdin=fin, stdout=fout, stderr=ferr, env=env, start_new_session=True,
                pass_fds=(program.fileno(), lockdown.fileno(), seccomp_filter.fileno()),
                preexec_fn=lambda: _child_setup(limits, cgroup.join_paths if cgroup else [], used),  # noqa: PLW1509
            )  # fmt: skip
            timed_out = False
            try:
                proc.wait(timeout=wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
        out = (base / "stdout.txt").read_bytes()
        err = (base / "stderr.txt").read_bytes()
        # a program killed by SIGXFSZ: -25 from Python, 128+25 through the namespace's shell
        truncated = len(out) >= limits.output_bytes or proc.returncode in (
            -signal.SIGXFSZ,
            128 + signal.SIGXFSZ,
        )
        return SandboxResult(
            stdout=out[: limits.output_bytes].decode("utf-8", "replace"),
            stderr=err[-4000:].decode("utf-8", "replace"),
            returncode=None if timed_out else proc.returncode,
            timed_out=timed_out,
            output_truncated=truncated,
            limited_by=cgroup.label if cgroup else "rlimits",
        )
    finally:  # also when the reward's own alarm interrupts the wait: nothing is left running
        if proc is not None:
            _kill(proc, cgroup)
        if cgroup is not None:
            cgroup.remove()
        shutil.rmtree(base, ignore_errors=True)
