"""Run a call in a container's network namespace, from the host side."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def in_netns(pid: int, fn: Callable[[], T]) -> T:
    """``fn()`` in the network namespace of process ``pid`` (a container's), as
    a sidecar or a Service's backend would reach it: one short-lived thread
    joins the namespace, so the test's own threads stay on the host. A socket
    made there stays in that namespace."""
    made: list[Any] = []

    def run() -> None:
        fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
        try:
            if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
                made.append(OSError(ctypes.get_errno(), "setns"))
                return
        finally:
            os.close(fd)
        try:
            made.append(fn())
        except Exception as e:
            made.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if isinstance(made[0], Exception):
        raise made[0]
    return made[0]  # type: ignore[no-any-return]
