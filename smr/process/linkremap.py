"""CRIU's link remaps of a local job's /dev/shm, carried in its checkpoint.

glibc's sem_open (every multiprocessing lock, queue and semaphore started by
'spawn': a PyTorch DataLoader's) creates /dev/shm/sem.XXXXXX, maps it, links
it to the semaphore's name and unlinks the first name: the creator's mapping
names a deleted path of a file that is still linked (the worker processes
open and map it by its name). CRIU dumps such a file only with --link-remap:
it hard-links the file as ``link_remap.N`` beside the deleted name (N a file
id of that dump, so two jobs' can be the same) and the restore opens it
through that link, then removes it. Left to CRIU, the links sit in the
host's /dev/shm (a local job has no /dev/shm of its own), the first restore
consumes them, and a leave-running dump (a heartbeat) deletes its own at
once: its image could never be restored.

So smr keeps them itself. ``capture``, run by CRIU as its post-dump action
(the tree still frozen, the links still there), copies each linked file and
notes its other names (the semaphore's) into the checkpoint's work
directory; ``discard_left`` then removes what a final dump left in
/dev/shm. ``put_back`` recreates each link for one restore from the copy,
as the dump saw it, under a host-wide lock (the names repeat across jobs),
and removes what the restore did not consume. CRIU restores every mapping
of that file in the tree (the workers' too, which had opened it by its
name) from the one link, so the processes share it as they did. The
file's other names (random, the job's own) are pointed at it unless they
are another user's: a worker started after the restore opens the
semaphore the tree uses. (A restore beside a job still running on this
host takes its semaphores' names over: the copies share no file, and the
one started later wins the names.)

A pod's /dev/shm is its own and carried whole (devshm.tar): there CRIU's
links travel with it, and only ``linked``, ``other_names`` and
``point_name`` serve (services/checkpointer/pod_dump.py, services/restorer/pod.py).

Everything in /dev/shm is the tenants': nothing here follows a link, and a
file is used only if it is a regular file of the owner recorded at the dump.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import shlex
import shutil
import stat
import struct
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson

from smr.contract.errors import PermanentError, TemporaryError
from smr.process.criuimages import fields, records

SHM = "/dev/shm"
PREFIX = "/dev/shm/"  # CRIU's names, in the dumped tree's mount namespace
CARRY = "linkremaps"  # the checkpoint's directory beside images/: remaps.json, one copy each
RECORDS = "remaps.json"
FAILED = "smr: cannot carry CRIU's link remaps: "  # the action's error line in CRIU's log
SCRIPT = "linkremap-action.sh"
# A pod's: each link's other names in its /dev/shm (a pod's links travel in devshm.tar).
POD_NAMES = "linkremap-names.json"
# One restore at a time puts links back on this host: the names repeat across jobs.
LOCK = Path("/run/lock/smr-link-remaps.lock")
REMAP_NAME = re.compile(r"link_remap\.\d+")

_LINKED = 0  # remap_type LINKED (remap-fpath.proto), also the field's default


class LinkRemapError(PermanentError):
    code = "link-remap-unsupported"


def linked(images: Path) -> list[tuple[str, str]]:
    """(link, deleted name) of each link remap of a dump: CRIU's paths,
    relative to the root of the dumped tree's mount namespace."""
    remaps = []
    for rec in records(images / "remap-fpath.img"):
        f = dict(fields(rec))
        if f.get(3, _LINKED) == _LINKED:
            remaps.append((f[1], f[2]))  # orig_id, remap_id
    names: dict[int, str] = {}
    for rec in records(images / "files.img"):
        entry = dict(fields(rec))
        reg = entry.get(3)  # file_entry.reg: a reg_file_entry
        if isinstance(reg, bytes):
            r = dict(fields(reg))
            names[r[1]] = r[6].decode(errors="surrogateescape")  # id, name
    return [(names[remap], names[orig]) for orig, remap in remaps]


def _shm() -> int:
    return os.open(SHM, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def _in_shm(path: str, what: str) -> str:
    name = path.removeprefix(PREFIX)
    if not path.startswith(PREFIX) or "/" in name or name in ("", ".", ".."):
        raise LinkRemapError(
            f"the job maps or holds open {what}, whose name was deleted while the file "
            "still has another: CRIU can save it only through a link beside it, which smr "
            f"carries only in {SHM}",
            hint="close or unmap that file before the checkpoint, or keep it in /dev/shm")
    return name


def capture(images: Path, carry: Path) -> list[dict[str, Any]]:
    """Copy each link CRIU made for this dump into ``carry``, with its
    file's other names in /dev/shm (CRIU's post-dump action: the tree is
    frozen, the links are there)."""
    remaps = linked(images)
    if not remaps:
        return []
    carry.mkdir(parents=True, exist_ok=True)
    records = []
    d = _shm()
    try:
        for link, orig in remaps:
            name = _in_shm(link, orig)
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=d)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise LinkRemapError(f"{SHM}/{name} is not a regular file")
                copy = carry / name
                with open(copy, "wb") as out, os.fdopen(os.dup(fd), "rb") as src:
                    shutil.copyfileobj(src, out)
            finally:
                os.close(fd)
            records.append({
                "link": name, "deleted": orig, "uid": st.st_uid, "gid": st.st_gid,
                "mode": stat.S_IMODE(st.st_mode), "dev": st.st_dev, "ino": st.st_ino,
                "names": other_names(d, name, st)})
    finally:
        os.close(d)
    (carry / RECORDS).write_bytes(orjson.dumps(records))
    return records


def other_names(d: int, link: str, st: os.stat_result) -> list[str]:
    """The names in directory ``d`` (a readable descriptor) of the file
    ``st`` besides ``link`` and CRIU's other links: the semaphore's."""
    found = []
    for entry in os.scandir(d):
        if entry.name == link or REMAP_NAME.fullmatch(entry.name):
            continue
        with contextlib.suppress(OSError):
            s = entry.stat(follow_symlinks=False)
            if (s.st_dev, s.st_ino) == (st.st_dev, st.st_ino):
                found.append(entry.name)
    return sorted(found)


def load(carry: Path) -> list[dict[str, Any]]:
    try:
        return list(orjson.loads((carry / RECORDS).read_bytes()))
    except FileNotFoundError:
        return []


def discard_left(carry: Path) -> None:
    """Remove the links a dump that did not let the tree run left in
    /dev/shm (a leave-running dump removed its own): the checkpoint carries
    them. Only the very files recorded: a name taken since is not ours."""
    records = load(carry)
    if not records:
        return
    d = _shm()
    try:
        for r in records:
            _unlink_if(d, r["link"], (r["dev"], r["ino"]))
    finally:
        os.close(d)


def _unlink_if(d: int, name: str, ident: tuple[int, int]) -> None:
    with contextlib.suppress(FileNotFoundError):
        s = os.stat(name, dir_fd=d, follow_symlinks=False)
        if (s.st_dev, s.st_ino) == ident and stat.S_ISREG(s.st_mode):
            os.unlink(name, dir_fd=d)


def action_script(work: Path, images: Path, carry: Path) -> Path:
    """The executable CRIU runs at each action of a dump (--action-script):
    ``capture`` at post-dump, and only when the dump remapped a file."""
    script = work / SCRIPT
    work.mkdir(parents=True, exist_ok=True)
    script.write_text(
        "#!/bin/sh\n"
        '[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] || exit 0\n'
        f"[ -s {shlex.quote(str(images / 'remap-fpath.img'))} ] || exit 0\n"
        f"exec {shlex.quote(sys.executable)} -m smr.process.linkremap "
        f"{shlex.quote(str(images))} {shlex.quote(str(carry))}\n")
    script.chmod(0o700)
    return script


@contextlib.asynccontextmanager
async def put_back(carry: Path) -> AsyncIterator[None]:
    """The links of ``carry`` in /dev/shm for the restore run inside this
    context, and no longer after it (CRIU removes those it used)."""
    records = load(carry)
    if not records:
        yield
        return
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    lock = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        await asyncio.to_thread(fcntl.flock, lock, fcntl.LOCK_EX)
        made = _link_all(carry, records)
        try:
            yield
        finally:
            d = _shm()
            try:
                for name, ident in made:
                    _unlink_if(d, name, ident)
            finally:
                os.close(d)
    finally:
        os.close(lock)  # releases the lock


def _link_all(carry: Path, records: list[dict[str, Any]]) -> list[tuple[str, tuple[int, int]]]:
    made: list[tuple[str, tuple[int, int]]] = []
    d = _shm()
    try:
        for r in records:
            name = r["link"]
            if not REMAP_NAME.fullmatch(name):
                raise LinkRemapError(f"checkpoint names {name!r} as a link remap")
            try:
                made.append((name, _link_one(d, carry, r)))
            except FileExistsError:
                raise TemporaryError(
                    f"{SHM}/{name}, which this restore needs for a file the job maps, exists: "
                    "another job's checkpoint on this host made one of that name",
                    code="link-remap-taken",
                    hint="the restore is retried; a file of that name that stays is a "
                         "leftover of an interrupted dump: remove it") from None
    except BaseException:
        for name, ident in made:
            _unlink_if(d, name, ident)
        raise
    finally:
        os.close(d)
    return made


def _link_one(d: int, carry: Path, r: dict[str, Any]) -> tuple[int, int]:
    """The file as the dump saw it, under the link's name, and under its
    other names where they are gone or still the dumped job's own file."""
    name = r["link"]
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=d)
    try:
        with open(carry / name, "rb") as src, os.fdopen(os.dup(fd), "wb") as out:
            shutil.copyfileobj(src, out)
        os.fchown(fd, r["uid"], r["gid"])
        os.fchmod(fd, r["mode"])
        st = os.fstat(fd)
        for other in r["names"]:
            point_name(d, fd, other, r["uid"])
    except BaseException:
        _unlink_if(d, name, (os.fstat(fd).st_dev, os.fstat(fd).st_ino))
        raise
    finally:
        os.close(fd)
    return st.st_dev, st.st_ino


def point_name(d: int, fd: int, other: str, uid: int) -> None:
    """``other`` names the restored file: a process that opens the
    semaphore by its name after the restore (a worker started then) must
    get the file the restored tree maps. The name is the job's own (random,
    made by its sem_open) unless it is now another user's or not a regular
    file: then it stays."""
    if "/" in other or other in ("", ".", ".."):
        raise LinkRemapError(f"checkpoint names {other!r} as a file in {SHM}")
    try:
        s = os.stat(other, dir_fd=d, follow_symlinks=False)
        if s.st_uid != uid or not stat.S_ISREG(s.st_mode):
            return
    except FileNotFoundError:
        pass
    tmp = f".smr-{os.getpid()}-{other}"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp, dir_fd=d)
    os.link(f"/proc/self/fd/{fd}", tmp, dst_dir_fd=d, follow_symlinks=True)
    os.rename(tmp, other, src_dir_fd=d, dst_dir_fd=d)


def main(argv: list[str]) -> int:
    try:
        capture(Path(argv[0]), Path(argv[1]))
    except (OSError, ValueError, KeyError, IndexError, struct.error, LinkRemapError) as e:
        # CRIU fails the dump on a non-zero exit and lets the tree run on.
        print(f"{FAILED}{e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
