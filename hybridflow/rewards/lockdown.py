"""The sandbox's last step before the program: load the seccomp filter, then exec the rest of the
command line (setpriv, which drops the user, every capability and the bounding set).

Run inside the sandbox's namespaces once its mounts are made, with the sandbox's Python and only
the standard library (`python -I -S lockdown.py BPF_FILE CMD...`): the filter (seccomp_filter.py,
compiled by libseccomp in the scorer) arrives as a file of BPF instructions on an open descriptor,
since hybridflow's own environment may live under a directory the sandbox hides. The filter
survives exec, so the program inherits it; no_new_privs, which an unprivileged filter needs, is
set first and is kept by everything after.
"""

import ctypes
import os
import sys

PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
INSTRUCTION_BYTES = 8  # struct sock_filter: u16 code, u8 jt, u8 jf, u32 k


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def load(bpf: bytes) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    program = ctypes.create_string_buffer(bpf, len(bpf))
    fprog = SockFprog(len(bpf) // INSTRUCTION_BYTES, ctypes.cast(program, ctypes.c_void_p))
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


def main(argv: list[str]) -> None:
    with open(argv[0], "rb") as f:
        bpf = f.read()
    if not bpf or len(bpf) % INSTRUCTION_BYTES:
        sys.exit(f"lockdown: {argv[0]} is not a BPF program ({len(bpf)} bytes)")
    load(bpf)
    os.execvp(argv[1], argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
