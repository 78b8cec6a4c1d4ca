"""The sandbox's seccomp filter, compiled once per process by libseccomp (through pyseccomp) to a
BPF program that `lockdown.py` loads inside the sandbox.

It refuses (EPERM) what could undo the sandbox's mounts or reach outside it: mounting, new
namespaces, tracing other processes, the kernel keyring, BPF, io_uring, loading kernel modules,
Unix-domain sockets (they reach servers through the read-only filesystem), and injecting terminal
input. Other architectures' system calls (a 32-bit int 0x80) kill the process (libseccomp's default).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import socket
import tempfile

REFUSED = (
    # filesystem views: the sandbox's read-only mounts and hidden directories stay as they are
    "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount", "fspick", "move_mount",
    "open_tree", "mount_setattr", "open_by_handle_at", "name_to_handle_at", "swapon", "swapoff",
    # namespaces and other processes
    "unshare", "setns", "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    # kernel objects that outlive or reach outside the sandbox
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd", "fanotify_init",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    # the machine itself
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot",
    "syslog", "acct", "quotactl", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
)  # fmt: skip
NAMESPACE_FLAGS = (
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
    0x00000080,  # CLONE_NEWTIME
)
TIOCSTI = 0x5412


def build_filter():
    import pyseccomp as seccomp  # loads libseccomp

    f = seccomp.SyscallFilter(
        seccomp.ALLOW
    )  # other architectures' syscalls are killed (libseccomp's default)
    deny = seccomp.ERRNO(errno.EPERM)
    for name in REFUSED:
        with contextlib.suppress(OSError, ValueError, RuntimeError):  # a syscall unknown here
            f.add_rule(deny, name)
    for flag in NAMESPACE_FLAGS:  # clone() making a namespace; clone3 passes flags in memory: refused
        f.add_rule(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    f.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")  # glibc falls back to clone()
    f.add_rule(deny, "socket", seccomp.Arg(0, seccomp.EQ, socket.AF_UNIX))
    f.add_rule(deny, "ioctl", seccomp.Arg(1, seccomp.EQ, TIOCSTI))
    return f


@functools.cache
def filter_bpf() -> bytes:
    """The filter as the kernel's BPF program (struct sock_filter[]), made once per process."""
    with tempfile.TemporaryFile() as f:
        build_filter().export_bpf(f)
        f.seek(0)
        return f.read()
