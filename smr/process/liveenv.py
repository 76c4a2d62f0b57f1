"""A variable of another process's environment as its C library holds it
now, which is what getenv() answers: /proc/PID/environ is only what the
process started with, and a job script changes os.environ (putenv) before a
library reads it.

The way there is the one the dynamic linker leaves for debuggers: the
executable's DT_DEBUG entry points to ``r_debug``, whose list of loaded
objects (glibc's ``link_map``, musl's ``dso``: the same first fields) is
searched in the order the linker binds symbols, for the first that defines
``__environ`` (an executable's copy-relocated one before the C library's
own). Its value is the live ``char **``.

Everything read is the process's own memory (/proc/PID/mem): only compared,
every count and length bounded, and all the reads of one lookup together
(MAX_READS); any inconsistency is an EnvironUnreadable, never a guess. A
statically linked program has no DT_DEBUG, so it is unreadable. A read
waits as long as the process's own memory takes to read (a mapping of a
FUSE file of its own), as a read of /proc/PID/environ does.
"""

from __future__ import annotations

import os
import struct

# How far a tenant's own structures are walked: a real process is far below
# each (a few hundred objects, thousands of variables, a chain of some tens).
MAX_OBJECTS = 4096
MAX_VARIABLES = 1 << 16
MAX_CHAIN = 1 << 16
MAX_DYNAMIC = 1024
MAX_VALUE = 64 << 10
# All the reads of one lookup together: the bounds above multiply (objects x
# names x chain), and a real process needs some thousands (400 objects and
# 5000 variables: under 6000).
MAX_READS = 1 << 17

_AT_PHDR, _AT_PHNUM = 3, 5
_PT_DYNAMIC, _PT_PHDR = 2, 6
_DT_NULL, _DT_HASH, _DT_STRTAB, _DT_SYMTAB, _DT_DEBUG = 0, 4, 5, 6, 21
_DT_GNU_HASH = 0x6FFFFEF5
# __environ first, in every object: it is what glibc's and musl's getenv read
# (an executable that copies it defines both names at one address); another
# object may export a variable of its own named environ.
_NAMES = (b"__environ", b"environ", b"_environ")


class EnvironUnreadable(Exception):
    """The process's live environment could not be found or read."""


class _Memory:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.reads = 0
        try:
            self.fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise EnvironUnreadable(f"cannot open process {pid}'s memory: {e}") from e

    def read(self, addr: int, size: int) -> bytes:
        self.reads += 1
        if self.reads > MAX_READS:
            raise EnvironUnreadable(f"more than {MAX_READS} reads of process {self.pid}'s "
                                    "memory without finding its environment")
        if not 0 < addr < 1 << 63:
            raise EnvironUnreadable(f"address {addr:#x} is not in process {self.pid}")
        try:
            data = os.pread(self.fd, size, addr)
        except OSError as e:
            raise EnvironUnreadable(f"reading {size} bytes at {addr:#x}: {e}") from e
        if len(data) != size:
            raise EnvironUnreadable(f"short read at {addr:#x}")
        return data

    def u64(self, addr: int) -> int:
        return int(struct.unpack("<Q", self.read(addr, 8))[0])

    def u32s(self, addr: int, n: int) -> tuple[int, ...]:
        return struct.unpack(f"<{n}I", self.read(addr, 4 * n))

    def cstr(self, addr: int, limit: int) -> bytes:
        """The string at ``addr``, to its NUL or ``limit`` bytes, read a page
        at a time: a short string may end just before unmapped memory."""
        out = b""
        while len(out) < limit:
            part = self.read(addr, min(4096 - addr % 4096, limit - len(out)))
            if (nul := part.find(b"\0")) >= 0:
                return out + part[:nul]
            out += part
            addr += len(part)
        return out

    def close(self) -> None:
        os.close(self.fd)


def _auxv(pid: int) -> dict[int, int]:
    try:
        with open(f"/proc/{pid}/auxv", "rb") as f:
            raw = f.read(8192)
    except OSError as e:
        raise EnvironUnreadable(f"cannot read process {pid}'s auxiliary vector: {e}") from e
    words = struct.unpack(f"<{len(raw) // 8}Q", raw[: len(raw) // 16 * 16])
    return dict(zip(words[::2], words[1::2], strict=True))


def _dynamic(mem: _Memory, addr: int, base: int) -> dict[int, int]:
    """An object's dynamic tags; a pointer the linker left unrelocated (the
    vDSO's, musl's) is made absolute."""
    tags: dict[int, int] = {}
    read = 0
    while read < MAX_DYNAMIC:
        # To the page's end at most: the section may end just before it.
        chunk = mem.read(addr, (4096 - addr % 4096) // 16 * 16 or 16)
        for tag, val in struct.iter_unpack("<qQ", chunk):
            if tag == _DT_NULL:
                return {t: (v + base if t != _DT_DEBUG and v < base else v)
                        for t, v in tags.items()}
            tags.setdefault(tag, val)
        read += len(chunk) // 16
        addr += len(chunk)
    raise EnvironUnreadable(f"a dynamic section at {addr:#x} has no end")


def _r_debug(mem: _Memory, pid: int) -> int:
    aux = _auxv(pid)
    phdr, phnum = aux.get(_AT_PHDR, 0), aux.get(_AT_PHNUM, 0)
    if not phdr or not 0 < phnum <= 256:
        raise EnvironUnreadable("the program's headers are not in its auxiliary vector")
    heads = [struct.unpack("<IIQQQQQQ", mem.read(phdr + 56 * i, 56)) for i in range(phnum)]
    at = {h[0]: h[3] for h in reversed(heads)}  # p_type -> p_vaddr, the first of each
    if _PT_PHDR not in at or _PT_DYNAMIC not in at:
        raise EnvironUnreadable("the program is statically linked (no dynamic section)")
    bias = phdr - at[_PT_PHDR]
    debug = _dynamic(mem, bias + at[_PT_DYNAMIC], 0).get(_DT_DEBUG, 0)
    if not debug:
        raise EnvironUnreadable("the dynamic linker left no r_debug")
    return debug


def _gnu_lookup(mem: _Memory, table: int, symtab: int, strtab: int,
                name: bytes) -> int | None:
    h = 5381
    for c in name:
        h = (h * 33 + c) & 0xFFFFFFFF
    nbuckets, symoffset, bloom_size, _ = mem.u32s(table, 4)
    if not nbuckets:
        return None
    buckets = table + 16 + 8 * bloom_size
    idx = mem.u32s(buckets + 4 * (h % nbuckets), 1)[0]
    if idx < symoffset:
        return None
    chain = buckets + 4 * nbuckets
    for _ in range(MAX_CHAIN):
        ch = mem.u32s(chain + 4 * (idx - symoffset), 1)[0]
        if (ch | 1) == (h | 1) and (value := _defined(mem, symtab, strtab, idx, name)):
            return value
        if ch & 1:
            return None
        idx += 1
    raise EnvironUnreadable("a symbol hash chain has no end")


def _sysv_lookup(mem: _Memory, table: int, symtab: int, strtab: int,
                 name: bytes) -> int | None:
    h = 0
    for c in name:
        h = (h << 4) + c
        g = h & 0xF0000000
        h = (h ^ (g >> 24)) & ~g & 0xFFFFFFFF
    nbucket, nchain = mem.u32s(table, 2)
    if not nbucket:
        return None
    idx = mem.u32s(table + 8 + 4 * (h % nbucket), 1)[0]
    for _ in range(MAX_CHAIN):
        if idx == 0 or idx >= nchain:
            return None
        if value := _defined(mem, symtab, strtab, idx, name):
            return value
        idx = mem.u32s(table + 8 + 4 * nbucket + 4 * idx, 1)[0]
    raise EnvironUnreadable("a symbol hash chain has no end")


def _defined(mem: _Memory, symtab: int, strtab: int, idx: int, name: bytes) -> int:
    """Symbol ``idx``'s value where it is ``name`` and defined here, else 0."""
    st_name, _, _, shndx, value, _ = struct.unpack("<IBBHQQ", mem.read(symtab + 24 * idx, 24))
    if shndx == 0 or not value:
        return 0
    return value if mem.cstr(strtab + st_name, len(name) + 1) == name else 0


def _environ_address(mem: _Memory, pid: int) -> int:
    """Where the live ``char **environ`` is: the first loaded object, in the
    linker's order, that defines it, by the names in _NAMES' order."""
    node = mem.u64(_r_debug(mem, pid) + 8)  # r_debug.r_map
    seen: set[int] = set()
    objects: list[tuple[int, dict[int, int]]] = []
    for _ in range(MAX_OBJECTS):
        if not node:
            break
        if node in seen:
            raise EnvironUnreadable("the list of loaded objects runs in a circle")
        seen.add(node)
        base, _name, ld, nxt = struct.unpack("<QQQQ", mem.read(node, 32))
        if ld:
            objects.append((base, _dynamic(mem, ld, base)))
        node = nxt
    else:
        raise EnvironUnreadable("the list of loaded objects has no end")
    for name in _NAMES:
        for base, tags in objects:
            symtab, strtab = tags.get(_DT_SYMTAB), tags.get(_DT_STRTAB)
            value = None
            if symtab and strtab and _DT_GNU_HASH in tags:
                value = _gnu_lookup(mem, tags[_DT_GNU_HASH], symtab, strtab, name)
            elif symtab and strtab and _DT_HASH in tags:
                value = _sysv_lookup(mem, tags[_DT_HASH], symtab, strtab, name)
            if value:
                return base + value
    raise EnvironUnreadable("no loaded object defines environ")


def getenv(pid: int, *keys: str) -> dict[str, str | None]:
    """Each of ``keys``' value in ``pid``'s environment as getenv() would
    find it now (the first one set), None where unset. EnvironUnreadable
    where the environment cannot be found or read (a statically linked
    program, a process gone or changing it during the read)."""
    wants = {key.encode() + b"=": key for key in keys}
    longest = max(map(len, wants), default=0)
    found: dict[str, str | None] = {}
    mem = _Memory(pid)
    try:
        at = mem.u64(_environ_address(mem, pid))
        seen = 0
        while seen < MAX_VARIABLES:
            # Pointers up to the page's end: the array may end on one.
            chunk = mem.read(at, (4096 - at % 4096) // 8 * 8 or 8)
            for (ptr,) in struct.iter_unpack("<Q", chunk):
                if not ptr:
                    return {key: found.get(key) for key in keys}
                head = mem.cstr(ptr, longest)
                for want, key in wants.items():
                    if key not in found and head.startswith(want):
                        value = mem.cstr(ptr + len(want), MAX_VALUE)
                        found[key] = value.decode(errors="replace")
            seen += len(chunk) // 8
            at += len(chunk)
        raise EnvironUnreadable(f"the environment has more than {MAX_VARIABLES} variables")
    finally:
        mem.close()
