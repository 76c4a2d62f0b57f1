"""Ports a restore must bind that the kernel still holds in TIME_WAIT.

CRIU restores a listening (or bound, unconnected) TCP socket by binding its
address again. When the job itself closed connections it had accepted on
that port, the kernel keeps each one in TIME_WAIT on the port for 60 s
(TCP_TIMEWAIT_LEN, fixed), and a socket made without SO_REUSEADDR (NCCL's
bootstrap listeners, Python's socketserver) cannot be bound beside them:
CRIU's own SO_REUSEADDR does not help, the old connection's flag counts
too. A restore into the namespace the job ran in (a local job restored on
its own host within that minute) then fails with "Can't bind inet socket:
Address already in use". A fresh network namespace (a pod's, another node)
holds none.

So such a restore first waits until no port its images bind is held that
way: at most a minute, reported as the answer's ``time_wait``. Established
connections need no wait: CRIU binds them in repair mode, which the kernel
lets through.
"""

from __future__ import annotations

import asyncio
import ipaddress
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

from smr.process.criuimages import fields, records

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

TCP_TIMEWAIT_S = 60.0  # the kernel's TCP_TIMEWAIT_LEN
_TCP, _LISTEN, _TIME_WAIT = 6, 10, "06"
_AF_INET = 2
IMAGES = ("files.img", "inetsk.img")  # CRIU 4 keeps sockets in the first


class Endpoint(NamedTuple):
    address: Address
    port: int

    def __str__(self) -> str:
        return f"{self.address}:{self.port}"


def _address(words: list[int], family: int) -> Address:
    raw = b"".join(struct.pack("<I", w) for w in words)  # CRIU copies the bytes as u32s
    return ipaddress.ip_address(raw[:4] if family == _AF_INET else raw[:16])


def _inet(entry: bytes) -> Endpoint | None:
    """The address a restore binds plainly for one inet_sk_entry, or None
    (not TCP, unbound, or a connection: those go back in repair mode)."""
    f: dict[int, int | bytes] = {}
    words: list[int] = []
    for num, value in fields(entry):
        if num == 11 and isinstance(value, int):  # src_addr, a repeated uint32
            words.append(value)
        else:
            f.setdefault(num, value)
    if f.get(5) != _TCP or not f.get(7) or not words:  # proto, src_port
        return None
    if f.get(6) != _LISTEN and f.get(8):  # state, dst_port: a connection
        return None
    return Endpoint(_address(words, int(f.get(3, _AF_INET))), int(f[7]))


def bound(images: Path) -> set[Endpoint]:
    """Every address the restore of ``images`` binds outside repair mode."""
    out = set()
    for rec in records(images / "files.img"):
        for num, value in fields(rec):
            if num == 4 and isinstance(value, bytes) and (ep := _inet(value)):  # file_entry.isk
                out.add(ep)
    for rec in records(images / "inetsk.img"):  # older CRIU's own image
        if ep := _inet(rec):
            out.add(ep)
    return out


def _proc_address(hexaddr: str) -> Address:
    raw = bytes.fromhex(hexaddr)
    # /proc/net/tcp prints each 32-bit word of the address in host order.
    return ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))


def time_waits(net: Path = Path("/proc/self/net")) -> Iterator[Endpoint]:
    """The local address of every TCP connection in TIME_WAIT in ``net``'s
    namespace."""
    for table in ("tcp", "tcp6"):
        try:
            rows = (net / table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 3 and cols[3] == _TIME_WAIT:
                addr, port = cols[1].split(":")
                yield Endpoint(_proc_address(addr), int(port, 16))


def _plain(a: Address) -> Address:
    return (a.ipv4_mapped or a) if isinstance(a, ipaddress.IPv6Address) else a


def held(wanted: set[Endpoint], net: Path = Path("/proc/self/net")) -> set[Endpoint]:
    """Those of ``wanted`` a TIME_WAIT connection keeps from binding: the same
    port on the same address, or either side the wildcard."""
    out = set()
    for tw in time_waits(net):
        for ep in wanted:
            if ep.port == tw.port and (ep.address.is_unspecified or tw.address.is_unspecified
                                       or _plain(ep.address) == _plain(tw.address)):
                out.add(ep)
    return out


async def wait_free(images: Path, *, limit: float = TCP_TIMEWAIT_S + 5,
                    on_wait: Callable[[set[Endpoint], float], None] | None = None,
                    net: Path = Path("/proc/self/net")) -> float:
    """Wait until no address the restore of ``images`` binds is held in
    TIME_WAIT in ``net``'s namespace, up to ``limit`` seconds (after it CRIU
    tries anyway and says what failed). Returns the seconds waited."""
    wanted = await asyncio.to_thread(bound, images)
    if not wanted:
        return 0.0
    t0 = time.monotonic()
    told = -10.0
    while (busy := await asyncio.to_thread(held, wanted, net)):
        waited = time.monotonic() - t0
        if waited >= limit:
            break
        if on_wait is not None and waited - told >= 5:
            on_wait(busy, waited)
            told = waited
        await asyncio.sleep(0.5)
    return time.monotonic() - t0 if time.monotonic() - t0 > 0.01 else 0.0
