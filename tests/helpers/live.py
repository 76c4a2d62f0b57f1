"""The in-process agents' live objects, found by type (their steps)."""

from __future__ import annotations

import gc
from typing import TypeVar

T = TypeVar("T")


def live(cls: type[T]) -> list[T]:
    """Every live object of ``cls`` in this process. A dead weak proxy met on
    the way is passed over: isinstance() on one raises ReferenceError."""
    found = []
    for o in gc.get_objects():
        try:
            if isinstance(o, cls):
                found.append(o)
        except ReferenceError:
            continue
    return found
