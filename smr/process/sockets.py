"""The sockets a process tree holds, and what a checkpoint does with its TCP
connections: the one place that decides.

CRIU saves listening TCP sockets, UDP sockets and unix sockets within the
tree as they are: a restored server listens on the same port (on another
node, at that node's address). Established TCP connections need a choice:

- ``keep``: saved with their sequence numbers (``--tcp-established``), the
  network locked for them while the tree is frozen. Right where the
  connection can go on: a checkpoint that leaves the process running, and a
  process stopped and restored on the same node, in the same network
  namespace (its peers see a pause, not an error).
- ``close``: not saved (``--tcp-close``). The process's sockets come back
  closed, so its next read or write on one fails like a reset, and its
  peers see the connection end when the original process stops. Right for a
  migration: the new node has another address (a pod has a new network
  namespace), so a kept connection could never reach its peer, and a
  connection held locked on a node that goes away would leave the peer
  waiting for a TCP timeout instead of reconnecting at once.

A workload may ask for ``close`` always (policy ``close``: a heartbeat then
never locks its connections, even for the few milliseconds of a dump).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
from pathlib import Path
from typing import Any, Literal

Tcp = Literal["keep", "close"]
POLICIES = ("auto", "close")  # what a workload may choose (smr exec --tcp, pod label)

# Reasons that mean the node is going away: the restore will be elsewhere.
LEAVING = frozenset({"drain", "preemption", "node-deleted", "suspended"})

_TCP_STATES = {"01": "established", "0A": "listening"}


def dump_mode(*, policy: str, leave_running: bool, reason: str, requested: str | None = None,
              same_netns_possible: bool = True) -> Tcp:
    """What a checkpoint does with established connections.

    ``requested``: the request names a mode (``smr checkpoint --close-connections``);
    ``keep`` is not followed for a final dump that no restore could keep.
    ``same_netns_possible``: False where a restore always gets a new network
    namespace (pod containers)."""
    if requested == "close":
        return "close"
    if requested == "keep":
        # Not for a final dump where the restore always gets a new network
        # namespace: its connections could never come back, only stay locked
        # (dead for good should the dump not be stored and the tree run on).
        return "keep" if leave_running or same_netns_possible else "close"
    if policy == "close":
        return "close"
    if leave_running:
        return "keep"
    if reason in LEAVING or not same_netns_possible:
        return "close"
    return "keep"


def restore_mode(manifest: dict[str, Any], *, same_place: bool) -> Tcp:
    """Connections come back only from a final checkpoint that kept them,
    restored in the same node's network namespace (``same_place``). Those of a
    leave-running checkpoint went on after it: their peers would only answer
    the old sequence numbers with a reset, so they are restored closed."""
    kept = (manifest.get("sockets") or {}).get("tcp") == "keep"
    return "keep" if kept and not manifest.get("leave_running") and same_place else "close"


def outcome(manifest: dict[str, Any], tcp: Tcp | None = None) -> dict[str, Any] | None:
    """A result's account: what the checkpoint held, and whether its
    connections were kept in this step (``tcp``; by default what the
    checkpoint itself did with them)."""
    held = manifest.get("sockets")
    if not held:
        return None
    done = tcp or held.get("tcp")
    return {**held, "connections": "kept" if done == "keep" else "closed"}


def inventory(pids: list[int]) -> dict[str, Any]:
    """The sockets the processes ``pids`` hold, by kind: listening TCP
    addresses, and counts of established TCP, UDP and unix sockets. Read from
    /proc in the processes' own network namespace."""
    inodes = _socket_inodes(pids)
    out: dict[str, Any] = {"listening": [], "established": 0, "udp": 0, "unix": 0}
    if not pids:
        return out
    net = Path(f"/proc/{pids[0]}/net")
    for proto in ("tcp", "tcp6"):
        for local, state, inode in _rows(net / proto, (1, 3, 9)):
            if inode not in inodes:
                continue
            kind = _TCP_STATES.get(state)
            if kind == "listening":
                out["listening"].append(f"tcp {_addr(local)}")
            elif kind == "established":
                out["established"] += 1
    for proto in ("udp", "udp6"):
        out["udp"] += sum(1 for *_, inode in _rows(net / proto, (1, 3, 9)) if inode in inodes)
    out["unix"] = sum(1 for (inode,) in _rows(net / "unix", (6,)) if inode in inodes)
    out["listening"] = sorted(set(out["listening"]))
    return out


def _socket_inodes(pids: list[int]) -> set[str]:
    inodes: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.scandir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(fd.path)
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
    return inodes


def _rows(path: Path, cols: tuple[int, ...]) -> list[tuple[str, ...]]:
    try:
        lines = path.read_text().splitlines()[1:]
    except OSError:
        return []
    rows = []
    for line in lines:
        f = line.split()
        if len(f) > max(cols):
            rows.append(tuple(f[c] for c in cols))
    return rows


def _addr(hexaddr: str) -> str:
    """"0100007F:1CBB" → "127.0.0.1:7355"; IPv6 as [::]:port."""
    host, port = hexaddr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        ip = ".".join(str(b) for b in raw[::-1])
    else:  # four little-endian 32-bit words
        words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
        ip = f"[{ipaddress.IPv6Address(words).compressed}]"
    return f"{ip}:{int(port, 16)}"


def summary(sockets: dict[str, Any] | None, *, restored: bool = False) -> str:
    """One line for a person: what the checkpoint held and did."""
    if not sockets:
        return ""
    parts = []
    if sockets.get("listening"):
        parts.append("listening on " + ", ".join(s.split(" ", 1)[1] for s in sockets["listening"]))
    n = sockets.get("established", 0)
    if n:
        done = sockets.get("connections") or ("kept" if sockets.get("tcp") == "keep" else "closed")
        parts.append(f"{n} TCP connection{'s' if n != 1 else ''} {done}"
                     + (" (the process sees a reset and its peers reconnect)"
                        if done == "closed" and restored else ""))
    return "; ".join(parts)
