"""Escapes tried as root and as an ordinary user: each attempt is refused inside the sandbox and
nothing outside it changes (files world-writable on purpose, so only the sandbox protects them)."""

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from hybridflow.rewards import sandbox
from hybridflow.rewards.sandbox import SandboxLimits, available

sys.path.insert(0, str(Path(__file__).parent))
import sandbox_probes  # noqa: E402 (a sibling helper module)

# no skip where the sandbox is missing: scoring code needs it, so its absence is a failure
assert available(), "the code sandbox needs util-linux (unshare, mount, setpriv) and libseccomp"
ROOT = os.geteuid() == 0


class Outside:
    """What a program must not touch: a hidden run directory, a hidden data file, a visible user
    file, a listening Unix socket (path and abstract), SysV objects, processes."""

    def __init__(self, owner: int = 0) -> None:
        # not under /tmp (the sandbox has a /tmp of its own): where the program would see them
        base = "/var/lib" if os.access("/var/lib", os.W_OK) else str(Path.home())
        self.dirs = [Path(tempfile.mkdtemp(prefix="hybridflow-escape-", dir=base)) for _ in range(3)]
        self.hide_dir, self.data_dir, self.outside = self.dirs
        for d in self.dirs:
            (d / "precious.txt").write_text("precious")
            os.chmod(d / "precious.txt", 0o666)
            os.chmod(d, 0o777)
            os.chown(d / "precious.txt", owner, owner) if ROOT else None
        self.hide_file = self.data_dir / "train.jsonl"
        self.hide_file.write_text('{"prompt": "secret"}\n')
        os.chmod(self.hide_file, 0o644)
        self.values = {
            "hide_dir": str(self.hide_dir),
            "hide_file": str(self.hide_file),
            "outside": str(self.outside),
            "socket_path": str(self.outside / "s.sock"),
            "abstract_name": f"hybridflow-escape-{secrets.token_hex(4)}",
            "sleep_marker": f"47.{secrets.randbelow(10**6):06d}",
        }
        self.connections = 0
        self.servers = [socket.socket(socket.AF_UNIX) for _ in range(2)]
        self.servers[0].bind(self.values["socket_path"])
        os.chmod(self.values["socket_path"], 0o777)
        self.servers[1].bind("\0" + self.values["abstract_name"])
        for s in self.servers:
            s.listen()
            s.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()
        self.sysv_before = self._sysv()

    def _accept(self) -> None:
        while not self._stop.is_set():
            for s in self.servers:
                try:
                    s.accept()[0].close()
                    self.connections += 1
                except OSError:
                    pass

    @staticmethod
    def _sysv() -> tuple[int, int]:
        return tuple(len(Path(f"/proc/sysvipc/{k}").read_text().splitlines()) for k in ("msg", "shm"))

    @property
    def hide(self) -> list[str]:
        return [str(self.hide_dir), str(self.hide_file)]

    def survivors(self) -> bool:
        deadline = time.monotonic() + 3  # the kernel takes a moment to reap a killed namespace
        while time.monotonic() < deadline:
            if subprocess.run(
                ["pgrep", "-f", f"sleep {self.values['sleep_marker']}"], capture_output=True
            ).returncode:
                return False
            time.sleep(0.1)
        return True

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for s in self.servers:
            s.close()
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)


def check_nothing_escaped(results: dict, out: Outside, *, expect_cgroup: bool) -> None:
    def printed(name):
        return results[name]["stdout"]

    assert "WROTE" not in printed("remount_root")
    assert printed("remount_root").count("refused") == 2
    assert "precious" not in printed("unhide") and "secret" not in printed("unhide")
    assert printed("unhide").splitlines()[-1] == "''"  # the data file reads empty (bound over by /dev/null)
    assert results["alive"]["ok"] and printed("alive").split() == ["alive", "sandbox", "refused"]
    assert "unshare rc -1 1" in printed("new_namespace") and "cmd rc 0" not in printed("new_namespace")
    caps = dict(line.split() for line in printed("capabilities").splitlines())
    assert caps == {
        "CapInh:": "0000000000000000", "CapPrm:": "0000000000000000", "CapEff:": "0000000000000000",
        "CapBnd:": "0000000000000000", "CapAmb:": "0000000000000000", "NoNewPrivs:": "1", "Seccomp:": "2",
    }, caps  # fmt: skip
    assert results["setsid_survivor"]["timed_out"]
    assert not out.survivors()
    assert "CONNECTED" not in printed("unix_socket") and out.connections == 0
    assert "ptrace -1 1" in printed("ptrace_keyring") and "add_key -1 1" in printed("ptrace_keyring")
    assert "msgget -1" not in printed("sysv_ipc")  # made inside, and gone with the namespace:
    assert Outside._sysv() == out.sysv_before
    memory = results["memory_per_run"]
    assert (
        memory["limited_by"] == ("cgroup v1", "cgroup v2")[0 if "v1" in memory["limited_by"] else 1]
        or not expect_cgroup
    )
    if memory["limited_by"] != "rlimits":  # the whole program is capped: not all four fit in 512 MB
        assert printed("memory_per_run").count("allocated") < 4, memory
    for d in out.dirs:  # nothing outside changed
        assert (d / "precious.txt").read_text() == "precious"
        assert sorted(p.name for p in d.iterdir()) in (
            ["precious.txt"],
            ["precious.txt", "s.sock"],
            ["precious.txt", "train.jsonl"],
        )


def _cgroup_possible() -> bool:
    return sandbox.ProgramCgroup.create(2**20, 8) is not None


def test_escapes_fail_as_whoever_runs_the_suite():
    """Root in CI; an ordinary user's suite (no root to become another user below) runs the same probes
    as itself, its namespaces then coming from a user namespace."""
    out = Outside()
    try:
        results = sandbox_probes.run_all(sandbox, out.values, out.hide)
        expect = _cgroup_possible()
        check_nothing_escaped(results, out, expect_cgroup=expect)
        if expect:  # where a cgroup can be made (root, cgroup v1 or v2) the cap is for the whole run
            assert results["memory_per_run"]["limited_by"].startswith("cgroup")
    finally:
        out.close()


def _user_copy(into: Path) -> Path:
    """A virtual environment an ordinary user can run: the system Python with the sandbox's own
    modules and pyseccomp, nothing of root's (its interpreter lives in root's private home)."""
    import pyseccomp

    subprocess.run(
        [sandbox.sandbox_python(), "-m", "venv", "--without-pip", str(into / "venv")], check=True, timeout=120
    )
    site = next((into / "venv" / "lib").glob("python3*/site-packages"))
    package = site / "hybridflow" / "rewards"
    package.mkdir(parents=True)
    (site / "hybridflow" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    for name in ("sandbox.py", "cgroup.py", "deadline.py", "lockdown.py", "seccomp_filter.py"):
        shutil.copy(Path(sandbox.__file__).with_name(name), package / name)
    shutil.copy(pyseccomp.__file__, site / "pyseccomp.py")
    shutil.copy(sandbox_probes.__file__, into / "sandbox_probes.py")
    subprocess.run(["chmod", "-R", "a+rX", str(into)], check=True)
    return into / "venv" / "bin" / "python"


@pytest.mark.skipif(not ROOT, reason="needs root to become an ordinary user")
def test_escapes_fail_as_an_ordinary_user():
    """As a normal user the namespaces come from a user namespace, where the program would be root
    with every capability but for the drop and the filter: remounting / was possible before."""
    home = Path(tempfile.mkdtemp(prefix="hybridflow-user-"))
    os.chmod(home, 0o755)
    out = Outside(owner=65534)
    try:
        python = _user_copy(home)
        run = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(python), str(home / "sandbox_probes.py"),
             json.dumps(out.values), *out.hide],
            capture_output=True, text=True, timeout=240, env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin"}, cwd=home,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        check_nothing_escaped(json.loads(run.stdout), out, expect_cgroup=False)
    finally:
        out.close()
        shutil.rmtree(home, ignore_errors=True)


def test_the_sandbox_dies_with_the_scorer_that_started_it():
    """A scoring worker killed at the reward's deadline (SIGKILL, no cleanup) takes its program along."""
    marker = f"53.{secrets.randbelow(10**6):06d}"
    scorer = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfrom hybridflow.rewards.sandbox import run_python, SandboxLimits\n"
         f"run_python('import os\\nos.execv(\"/bin/sleep\", [\"sleep\", \"{marker}\"])', limits=SandboxLimits(wall_s=60))"],
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True).returncode:
            assert time.monotonic() < deadline and scorer.poll() is None, "the program never started"
            time.sleep(0.1)
        scorer.send_signal(signal.SIGKILL)
        scorer.wait(timeout=10)
        deadline = time.monotonic() + 3
        while not subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True).returncode:
            assert time.monotonic() < deadline, "the sandboxed program outlived its scorer"
            time.sleep(0.1)
    finally:
        scorer.kill()


def test_the_reward_deadline_is_the_sandboxs_deadline():
    """Ten tests of a program that loops, each allowed 10 s by the sandbox, under a 1.5 s reward
    deadline: the call ends near 1.5 s, counted as a timeout, with nothing left running."""
    from hybridflow.rewards.executor import _run_items
    from hybridflow.rewards.loading import builtin_function

    marker = f"59.{secrets.randbelow(10**6):06d}"
    response = f"```python\nimport os\nos.system('sleep {marker}')\n```"
    truth = {"inputs": [str(i) for i in range(10)], "outputs": ["x"] * 10}
    options = {"code_options": {"limits": SandboxLimits(wall_s=10, cpu_s=10)}}
    start = time.monotonic()
    [outcome] = _run_items(builtin_function(), [("code", response, truth, {})], 1.5, options)
    elapsed = time.monotonic() - start
    assert outcome.timeout and 1.4 < elapsed < 3.0, (outcome, elapsed)
    time.sleep(0.3)
    assert subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True).returncode == 1


def _fake_cgroupfs(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_cgroup_v2_layout_is_written_where_the_kernel_reads_it(tmp_path):
    """This machine offers v1 only, so v2's files are checked on a copy of the layout: a group under
    our own with memory.max, memory.swap.max and pids.max, joined through its cgroup.procs; none when
    our cgroup does not delegate both controllers."""
    from hybridflow.rewards.cgroup import ProgramCgroup

    own = tmp_path / "proc-self-cgroup"
    own.write_text("0::/user.slice/job\n")
    _fake_cgroupfs(tmp_path / "fs", {"cgroup.controllers": "memory pids", "user.slice/job/cgroup.subtree_control": "memory",
                                     "user.slice/job/cgroup.procs": ""})  # fmt: skip
    assert (
        ProgramCgroup.create(2**29, 16, root=tmp_path / "fs", self_cgroup=own) is None
    )  # no pids: v1 then, absent
    (tmp_path / "fs" / "user.slice/job/cgroup.subtree_control").write_text("memory pids\n")
    group = ProgramCgroup.create(2**29, 16, root=tmp_path / "fs", self_cgroup=own)
    assert group is not None and group.label == "cgroup v2"
    (d,) = group.dirs
    assert d.parent == tmp_path / "fs" / "user.slice" / "job" and d.name.startswith("hybridflow-sandbox-")
    assert (d / "memory.max").read_text() == str(2**29) and (d / "pids.max").read_text() == "16"
    assert group.join_paths == [str(d / "cgroup.procs")]


def test_the_cgroup_v1_layout_caps_memory_and_processes(tmp_path):
    from hybridflow.rewards.cgroup import ProgramCgroup

    own = tmp_path / "proc-self-cgroup"
    own.write_text("4:memory:/job\n8:pids:/job\n0::/\n")
    _fake_cgroupfs(tmp_path / "fs", {"memory/cgroup.procs": "", "memory/job/cgroup.procs": "",
                                     "pids/cgroup.procs": "", "pids/job/cgroup.procs": ""})  # fmt: skip
    group = ProgramCgroup.create(2**29, 16, root=tmp_path / "fs", self_cgroup=own)
    assert group is not None and group.label == "cgroup v1"
    memory, pids = group.dirs
    assert (
        memory.parent == tmp_path / "fs" / "memory" / "job"
        and pids.parent == tmp_path / "fs" / "pids" / "job"
    )
    assert (memory / "memory.limit_in_bytes").read_text() == str(2**29) and (
        pids / "pids.max"
    ).read_text() == "16"
    assert not (memory / "memory.memsw.limit_in_bytes").exists()  # swap accounting off: not made up


def test_paths_with_spaces_are_hidden_and_mounts_with_spaces_made_read_only():
    """The hide list is one path a line (a shell split 'my data' into two names, neither hidden),
    and a host mount point with a space is made read-only too (mountinfo writes it as \\040)."""
    base = "/var/lib" if os.access("/var/lib", os.W_OK) else str(Path.home())
    hidden = Path(tempfile.mkdtemp(prefix="hybridflow secret ", dir=base))
    (hidden / "token").write_text("secret")
    mount_point = Path(tempfile.mkdtemp(prefix="hybridflow mount ", dir=base))
    mounted = ROOT and subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(mount_point)]).returncode == 0
    try:
        os.chmod(mount_point, 0o777)
        program = (
            "import os\n"
            f"print(sorted(os.listdir({str(hidden)!r})))\n"
            f"try:\n    open({str(mount_point / 'x')!r}, 'w').write('x'); print('wrote')\n"
            "except OSError as e:\n    print('refused', e.strerror)\n"
        )
        r = sandbox.run_python(program, hide=[str(hidden)])
        assert r.ok, r.stderr
        assert r.stdout.splitlines() == ["[]", "refused Read-only file system"], r.stdout
        assert not (mount_point / "x").exists()
    finally:
        if mounted:
            subprocess.run(["umount", str(mount_point)])
        shutil.rmtree(hidden, ignore_errors=True)
        shutil.rmtree(mount_point, ignore_errors=True)


@pytest.mark.skipif(not ROOT, reason="needs root to become an ordinary user")
def test_an_ordinary_users_threads_elsewhere_leave_the_program_its_processes():
    """RLIMIT_NPROC counts a user's threads, not only the processes /proc lists: with 300 threads
    held by another of the user's processes, the sandboxed program can still start a child, and
    the user's home (~/.netrc) is hidden from it."""
    home = Path(
        tempfile.mkdtemp(prefix="hybridflow-user-", dir="/var/lib")
    )  # not /tmp: the sandbox has its own
    os.chmod(home, 0o755)
    try:
        python = _user_copy(home)
        (home / ".netrc").write_text("machine example.com password hunter2\n")
        subprocess.run(["chown", "-R", "65534:65534", str(home / ".netrc")], check=True)
        user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "HOME": str(home)}
        holder = subprocess.Popen(
            [*user, str(python), "-c", "import threading, time\n"
             "[threading.Thread(target=time.sleep, args=(120,), daemon=True).start() for _ in range(300)]\n"
             "print('ready', flush=True); time.sleep(120)"],
            stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        try:
            assert holder.stdout.readline().strip() == "ready"
            program = (
                "import os, subprocess, sys\n"
                "print(subprocess.run([sys.executable, '-c', 'print(7)'], capture_output=True, text=True).stdout.strip())\n"
                f"print(os.path.exists({str(home / '.netrc')!r}))\n"
            )
            run = subprocess.run(
                [*user, str(python), "-c", "import sys\nfrom hybridflow.rewards import sandbox\n"
                 "r = sandbox.run_python(sys.argv[1])\nprint(repr(r.stdout), r.ok, repr(r.stderr[-300:]))", program],
                capture_output=True, text=True, timeout=120, env=env, cwd=home,
            )  # fmt: skip
            assert run.returncode == 0, run.stderr[-2000:]
            assert run.stdout.startswith("'7\\nFalse\\n' True"), run.stdout
        finally:
            holder.kill()
            holder.wait()
    finally:
        shutil.rmtree(home, ignore_errors=True)
