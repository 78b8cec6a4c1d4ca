"""Escape attempts for the sandbox, run by test_sandbox_escapes.py as root and as an ordinary user.

Kept free of pytest and of hybridflow's heavy imports: the ordinary user's copy runs it with only
the sandbox's own modules. Each probe is a program; what it prints is judged by the test, together
with what changed (or did not) outside the sandbox.
"""

from __future__ import annotations

import json
import sys

LIBC = "import ctypes, ctypes.util, os\nlibc = ctypes.CDLL(ctypes.util.find_library('c'), use_errno=True)\n"

PROBES = {
    # an ordinary program runs; the host name is the sandbox's own; the network is unreachable
    "alive": (
        "import socket\nprint('alive', socket.gethostname())\n"
        "try:\n    socket.create_connection(('127.0.0.1', 22), timeout=1)\nexcept OSError:\n    print('refused')\n"
    ),
    # remount / read-write (command and syscall), then write where the user's file lives
    "remount_root": LIBC
    + (
        "os.system('mount -o remount,rw / 2>/dev/null; mount -o remount,rw {hide_dir} 2>/dev/null')\n"
        "libc.mount(b'none', b'/', None, 0x20 | 0x1000, None)\n"  # MS_REMOUNT | MS_BIND
        "for target in ('{hide_dir}/precious.txt', '{outside}/precious.txt'):\n"
        "    try:\n"
        "        open(target, 'w').write('overwritten'); print('WROTE', target)\n"
        "    except OSError as e:\n"
        "        print('refused', e.errno)\n"
    ),
    # take the hiding mount away and read the run directory
    "unhide": LIBC
    + (
        "os.system('umount {hide_dir} 2>/dev/null; umount -l {hide_dir} 2>/dev/null')\n"
        "libc.umount2(b'{hide_dir}', 2)\n"
        "print(os.listdir('{hide_dir}'))\n"
        "try:\n    print(open('{hide_dir}/precious.txt').read())\nexcept OSError as e:\n    print('refused', e.errno)\n"
        "print(repr(open('{hide_file}').read()))\n"
    ),
    # a new user namespace would give back every capability
    "new_namespace": LIBC
    + (
        "print('unshare rc', libc.unshare(0x10000000), ctypes.get_errno())\n"
        "print('cmd rc', os.system('unshare -r -m true 2>/dev/null'))\n"
    ),
    "capabilities": (
        "for line in open('/proc/self/status'):\n"
        "    if line.split(':')[0] in ('CapInh', 'CapPrm', 'CapEff', 'CapBnd', 'CapAmb', 'NoNewPrivs', 'Seccomp'):\n"
        "        print(line.split()[0], line.split()[1])\n"
    ),
    # a process that leaves the session outlives nothing: the namespace dies at the deadline
    "setsid_survivor": (
        "import os, time\n"
        "if os.fork() == 0:\n    os.setsid()\n    os.execv('/bin/sleep', ['sleep', '{sleep_marker}'])\n"
        "time.sleep(60)\n"
    ),
    "unix_socket": (
        "import socket\n"
        "for address in ('{socket_path}', '\\0{abstract_name}'):\n"
        "    try:\n"
        "        s = socket.socket(socket.AF_UNIX); s.connect(address); print('CONNECTED', repr(address))\n"
        "    except OSError as e:\n"
        "        print('refused', e.errno)\n"
    ),
    "ptrace_keyring": LIBC
    + (
        "print('ptrace', libc.ptrace(16, 1, 0, 0), ctypes.get_errno())\n"  # PTRACE_ATTACH to init
        "print('add_key', libc.syscall(248, b'user', b'hf', b'x', 1, -3), ctypes.get_errno())\n"  # session keyring
    ),
    # System V objects live in the sandbox's IPC namespace and die with it
    "sysv_ipc": LIBC
    + "print('msgget', libc.msgget(0, 0o1600))\nprint('shmget', libc.shmget(0, 4096, 0o1600))\n",
    # memory for the whole program: four processes of 300 MB each against a 512 MB limit
    "memory_per_run": (
        "import os\nkids = []\n"
        "for _ in range(4):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        try:\n            x = b'x' * (300 * 2**20); print('allocated', flush=True)\n            import time; time.sleep(1.5)\n"
        "        except MemoryError:\n            print('refused', flush=True)\n"
        "        os._exit(0)\n"
        "    kids.append(pid)\n"
        "for pid in kids:\n    os.waitpid(pid, 0)\n"
    ),
}


def run_all(sandbox, values: dict, hide: list[str]) -> dict:
    limits = sandbox.SandboxLimits(wall_s=4.0, cpu_s=4, memory_mb=512, processes=64)
    out = {}
    for name, program in PROBES.items():
        r = sandbox.run_python(program.format(**values), limits=limits, hide=hide)
        out[name] = {
            "stdout": r.stdout,
            "stderr": r.stderr,
            "ok": r.ok,
            "timed_out": r.timed_out,
            "limited_by": r.limited_by,
        }
    return out


if __name__ == "__main__":  # the ordinary user's run: python sandbox_probes.py VALUES_JSON HIDE...
    from hybridflow.rewards import sandbox as _sandbox

    print(json.dumps(run_all(_sandbox, json.loads(sys.argv[1]), sys.argv[2:])))
