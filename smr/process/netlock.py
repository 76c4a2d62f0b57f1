"""Undoing what a dump that kept TCP connections leaves behind, for a tree
that runs on instead of being restored.

A dump with ``--tcp-established`` that leaves the tree stopped (or kills it)
expects a restore on this node: CRIU keeps each dumped socket in TCP repair
mode (it sends nothing, not even a reset) and an nftables table,
``inet CRIU-<run id>``, dropping the connections' packets, so that the peers
see a pause until the restore, which unlocks both. If the checkpoint cannot be
stored, no restore comes: smr continues the stopped tree, and without this the
connections stay dead for good (the process writes into a socket that never
sends; its peer's packets are dropped) and the table stays in the node's
network namespace for ever. So does a CRIU killed before it ends (past its
timeout, by the OOM killer), whatever the dump: it never unlocks.

Both are undone the way CRIU's restore does: repair mode off on each of the
tree's TCP sockets in it (a copy of the descriptor through pidfd_getfd(2);
the socket is the process's, unchanged otherwise), then the
table deleted (the nft command; `make setup` and the agent image install it).
Only the table of this dump's CRIU run is touched: another job's dump may be
holding its own at the same moment.

A final dump that locked no connection leaves its table all the same: CRIU
makes one for every ``--tcp-established`` dump of a tree in the node's own
network namespace, and only a restore in that namespace deletes it. A job
restored on another node, or never, would leave it for good: two chains on
the node's input and output paths that every packet walks, and every nft
command slower (300 such tables made one `nft list tables` take 6 s).
``drop_unused`` deletes an empty one once its dump is stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Any

from smr.process.tree import process_tree

log = logging.getLogger(__name__)

TCP_REPAIR = 19  # linux/tcp.h
TCP_REPAIR_OFF = 0
_SYS_PIDFD_GETFD = 438  # x86_64 and arm64 (asm-generic) alike

_RUN_ID = re.compile(r"CRIU run id = ([0-9a-f-]{36})")
# CRIU names its table "inet CRIU-<run id>" in a 32-byte buffer: the id is cut
# after 21 characters (criu/netfilter.c, nftables_get_table).
_TABLE_ID_CHARS = 21


def table_of(dump_log: Path) -> str | None:
    """The nftables table a CRIU dump locked its connections with, from the
    run id on the first line of its log (written at -v4), or None."""
    try:
        with open(dump_log, "rb") as f:
            head = f.read(4096).decode(errors="replace")
    except OSError:
        return None
    m = _RUN_ID.search(head)
    return f"CRIU-{m.group(1)[:_TABLE_ID_CHARS]}" if m else None


async def release(root: int, dump_log: Path) -> bool:
    """Give the tree under ``root`` its kept connections back after the dump
    logged in ``dump_log``: repair mode off, the dump's lock table deleted.
    True if there was a lock to undo (none where CRIU unlocked itself). Call
    it before a stopped tree runs again: a process continued first would
    write into a socket that sends nothing."""
    table = table_of(dump_log)
    if table is None:
        return False
    if nft_binary() is None:
        log.warning("nft is missing: CRIU's lock table inet %s may stay, and the TCP "
                    "connections of process %d stay dead; install nftables (`make setup` "
                    "does)", table, root)
        return False
    listed = await _run_nft("list", "table", "inet", table)
    if listed is not None and listed[0] != 0:
        return False  # CRIU unlocked itself (a failed dump) or kept nothing
    # Where nft could not tell (it did not start, or hung), the tree gets its
    # sockets back all the same: repair mode off touches only sockets CRIU
    # put in it, and a job left stopped for want of nft is worse than a table
    # left behind.
    turned = await asyncio.to_thread(repair_off, process_tree(root))
    if await _nft("delete", "table", "inet", table, quiet=True):
        log.info("released %d kept TCP connection(s) of process %d and CRIU's lock %s",
                 turned, root, table)
    else:
        log.warning("turned repair mode off on %d TCP connection(s) of process %d, but "
                    "CRIU's lock table inet %s could not be deleted: their packets are "
                    "dropped until it is (`nft delete table inet %s`)", turned, root, table,
                    table)
    return True


async def drop(dump_log: Path) -> bool:
    """Delete the lock table of the dump logged in ``dump_log``, whatever it
    holds: for a dump no restore can ever use (unfinished, refused, never
    stored) of a tree that is gone, whose kept connections nothing will
    take back. True if deleted."""
    table = table_of(dump_log)
    return table is not None and await _nft("delete", "table", "inet", table, quiet=True)


async def drop_unused(dump_log: Path) -> bool:
    """Delete the lock table of the finished dump logged in ``dump_log`` if
    it locks no connection (both of CRIU's sets empty): it holds nothing a
    restore needs, and CRIU's restore goes on when the table it would
    delete is gone (criu/net.c, network_unlock). A table of any other
    shape, or one nft cannot show as JSON, is left as it is. True if
    deleted."""
    table = table_of(dump_log)
    if table is None:
        return False
    shown = await _nft_json("list", "table", "inet", table)
    if shown is None or not _locks_nothing(shown):
        return False
    return await _nft("delete", "table", "inet", table, quiet=True)


# The sets CRIU's connection lock adds each kept connection to (criu/netfilter.c).
_LOCK_SETS = {"conns4", "conns6"}


def _locks_nothing(shown: dict[str, Any]) -> bool:
    items = shown.get("nftables")
    if not isinstance(items, list):
        return False
    sets = [i["set"] for i in items if isinstance(i, dict) and isinstance(i.get("set"), dict)]
    return {s.get("name") for s in sets} == _LOCK_SETS and len(sets) == len(_LOCK_SETS) \
        and not any(s.get("elem") for s in sets)


def repair_off(pids: list[int]) -> int:
    """Turn TCP repair mode off on each TCP socket the processes ``pids``
    hold that is in it; how many. Not only established ones: CRIU keeps a
    half-closed connection too (CLOSE_WAIT: the peer has sent all it will and
    waits for the answer; FIN_WAIT, LAST_ACK, CLOSING), and one left in
    repair mode sends nothing, not even its close. A socket not in repair
    mode is left as it is (turning it off would reset its SO_REUSEADDR and
    send a window probe), so is every socket of a process that only took a
    listed pid meanwhile."""
    done = 0
    for pid in pids:
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            continue  # gone meanwhile
        try:
            for fd in _socket_fds(pid):
                with contextlib.suppress(OSError):
                    copy = _pidfd_getfd(pidfd, fd)
                    try:
                        s = socket.socket(fileno=copy)
                        try:
                            if s.family in (socket.AF_INET, socket.AF_INET6) \
                                    and s.type == socket.SOCK_STREAM \
                                    and s.getsockopt(socket.IPPROTO_TCP, TCP_REPAIR):
                                s.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, TCP_REPAIR_OFF)
                                done += 1
                        finally:
                            s.detach()
                    finally:
                        os.close(copy)
        finally:
            os.close(pidfd)
    return done


def _socket_fds(pid: int) -> list[int]:
    fds = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError, ValueError):
                # readlink of a /proc fd entry is the kernel's text, never a
                # path of the tenant's that would be followed.
                if os.readlink(entry.path).startswith("socket:["):
                    fds.append(int(entry.name))
    return fds


_libc = ctypes.CDLL(None, use_errno=True)


def _pidfd_getfd(pidfd: int, fd: int) -> int:
    copy = _libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
    if copy < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(copy)


def nft_binary() -> str | None:
    return shutil.which("nft") or next(
        (p for p in ("/usr/sbin/nft", "/sbin/nft") if os.access(p, os.X_OK)), None)


# An nft command that takes longer is given up (it is killed): 300 tables
# made one listing take 6 s on a two-core machine.
NFT_TIMEOUT_S = 30.0


async def _run_nft(*args: str) -> tuple[int, bytes, bytes] | None:
    """nft's exit status, output and errors; None where it could not be run
    or did not end in NFT_TIMEOUT_S (said in the log): what calls it is
    cleanup, which must never fail the step it follows."""
    nft = nft_binary()
    if nft is None:
        return None
    try:
        proc = await asyncio.create_subprocess_exec(
            nft, *args, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
    except OSError as e:
        log.warning("cannot run nft %s: %s", " ".join(args), e)
        return None
    try:
        out, err = await asyncio.wait_for(proc.communicate(), NFT_TIMEOUT_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        log.warning("nft %s did not end in %.0f s; killed", " ".join(args), NFT_TIMEOUT_S)
        return None
    return proc.returncode or 0, out, err


async def _nft_json(*args: str) -> dict[str, Any] | None:
    ran = await _run_nft("-j", *args)
    if ran is None or ran[0] != 0:
        return None
    try:
        shown = json.loads(ran[1])
    except ValueError:
        return None
    return shown if isinstance(shown, dict) else None


async def _nft(*args: str, quiet: bool = False) -> bool:
    ran = await _run_nft(*args)
    if ran is None:
        return False
    if ran[0] != 0 and not quiet:
        log.warning("nft %s failed: %s", " ".join(args), ran[2].decode(errors="replace").strip())
    return ran[0] == 0
