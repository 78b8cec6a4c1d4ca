"""Worker groups: how the controller reaches a role. The in-process group runs the role here; the
Ray group (distributed issue) runs the same role class on many workers behind the same `call`."""

from __future__ import annotations

from typing import Any, Protocol


class WorkerGroup(Protocol):
    def call(self, method: str, *args: Any, **kwargs: Any) -> Any: ...


class InProcessWorkerGroup:
    """One worker in this process: `call` is a direct method call on the role."""

    def __init__(self, role: Any) -> None:
        self.role = role

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.role, method)(*args, **kwargs)
