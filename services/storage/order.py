"""Which of two generations of a checkpoint holds the later state.

A generation's number says when it was committed, not when it was dumped:
a dump stored by a recovery (its worker died between dump and commit) is
committed after dumps taken later. A manifest's ``dump`` records the dump
sequence its step took under the job's (or container's) lock as the dump
started (``seq``, from the lock bucket ``lock_epoch``), so two dumps of one
bucket compare by it. Two of different buckets (one made again starts its
sequence over) compare by their buckets' epochs (each the creation time of
its bucket's stream, on NATS's clock): every dump of a bucket made again
started after it was made, and every dump of the old one took its sequence
before that one was lost, so nodes' clocks, which may differ by more than
two dumps lie apart, never order them. Epochs that are not timestamps fall
back to the time each dump started (``started_at``, the node's clock).
Manifests without a stamp (older smr), or two started in the same
millisecond, compare by number, as before.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any, Protocol, TypeVar

from smr.contract.messages import epoch


class HasManifest(Protocol):
    @property
    def manifest(self) -> dict[str, Any]: ...


def _when(ts: object) -> float | None:
    try:
        return epoch(str(ts))
    except ValueError:
        return None


def _stamp(m: dict[str, Any]) -> tuple[str, int, float | None] | None:
    d = m.get("dump")
    if not isinstance(d, dict) or not isinstance(d.get("seq"), int) or \
            not isinstance(d.get("lock_epoch"), str):
        return None
    try:
        started: float | None = epoch(str(d.get("started_at")))
    except ValueError:
        started = None
    return d["lock_epoch"], d["seq"], started


def compare(a: dict[str, Any], b: dict[str, Any]) -> int:
    """<0, 0 or >0 as manifest ``a`` holds an earlier, the same or a later
    state than manifest ``b``."""
    sa, sb = _stamp(a), _stamp(b)
    if sa and sb and sa[0] == sb[0] and sa[1] != sb[1]:
        return -1 if sa[1] < sb[1] else 1
    if sa and sb and sa[0] != sb[0]:
        ea, eb = _when(sa[0]), _when(sb[0])
        if ea is not None and eb is not None and ea != eb:
            return -1 if ea < eb else 1
    if sa and sb and sa[0] != sb[0] and None not in (sa[2], sb[2]) and sa[2] != sb[2]:
        return -1 if sa[2] < sb[2] else 1  # type: ignore[operator]
    ga, gb = int(a["generation"]), int(b["generation"])
    return (ga > gb) - (ga < gb)


def dumped_before(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Was ``a``'s dump taken before ``b``'s (so it never replaces it as latest)?"""
    return compare(a, b) < 0


G = TypeVar("G", bound=HasManifest)


def newest_first(gens: Iterable[G]) -> list[G]:
    """``gens`` from the latest state to the earliest (retention's rank)."""
    return sorted(gens, key=functools.cmp_to_key(lambda x, y: compare(y.manifest, x.manifest)))
