"""A Python child process linked by a socket pair: `python -m MODULE FD`, its first message what it
needs. Not multiprocessing's spawn, which imports the caller's main script again in the child: a
script without an `if __name__ == "__main__":` guard (TRL's quick starts have none) would start its
run over there. Used by the scoring workers and the HTTP front processes."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path

PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])  # where `hybridflow` imports from here


def start_child(
    module: str, first_message, *, env_extra: dict[str, str] | None = None, pass_fds: tuple[int, ...] = ()
) -> tuple[subprocess.Popen, Connection]:
    """`python -m module FD` with `first_message` sent on the link (pickled: what it holds must be
    importable by name, not defined in the caller's script); (process, link)."""
    ours, theirs = socket.socketpair()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    env |= env_extra or {}
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", module, str(theirs.fileno())],
            pass_fds=(theirs.fileno(), *pass_fds),
            env=env,
        )
    finally:
        theirs.close()
    link = Connection(ours.detach())
    link.send(first_message)
    return child, link


def child_link() -> Connection:
    """In the child (`if __name__ == "__main__"` of MODULE): the link to its parent."""
    return Connection(int(sys.argv[1]))


class ChildProcess:
    """A Popen with the few calls of multiprocessing.Process the pools use."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)
