"""Is a dump on disk whole? Asked before a dump found on disk is stored.

CRIU writes its images without fsync, and writeback is not ordered across
files: after a host crash its log may say "Dumping finished successfully"
while a page image lost its tail, and a restore of it fails ("Reached EOF
unexpectedly while reading page from image") or, where the file system
shows zeros, resumes on zeroed memory.

Each ``pages-N.img`` holds exactly the pages its pagemaps mark present
(CRIU's PE_PRESENT), nothing else: its size against theirs catches a cut
page image without reading a page. The images of the process tree
(inventory, pstree, each thread's core; a zombie's own core only), every
pagemap and the other images of records alone (``RECORDS_ONLY``) are read
through, record by record, and each ghost file's chunks (a deleted file
held open) with their lengths. Not seen: a protobuf image cut exactly on a
record boundary (a ghost file's on a chunk's), or pages zeroed in place; a
dump from an earlier boot is judged by its stamp instead
(services/checkpointer/dumpstamp).
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

from smr.process.criuimages import Torn, chunked_ghost, fields, uints, whole_records

# criu/include/pagemap.h
PE_PARENT = 1 << 0  # the pages are in the parent (pre-dump) images
PE_PRESENT = 1 << 2  # the pages are in this directory's pages-N.img
# criu/include/pstree.h (compel's task states): a zombie is dumped as dead.
TASK_DEAD = 2
# A chain of pre-dumps is at most this deep (smr takes one).
MAX_PARENTS = 8
# Images CRIU writes as records alone, read through like the tree's: each
# process's memory layout, ids, fs and descriptors, and the files they name.
# Others carry raw bytes after their records (pipe and socket queues, TCP
# streams, tmpfs archives), which a record reader cannot judge; a ghost file's
# chunks record their own lengths (criuimages.chunked_ghost).
RECORDS_ONLY = ("mm-*.img", "ids-*.img", "fs-*.img", "fdinfo-*.img", "files.img")


def _tree(images: Path) -> str | None:
    """What of the process tree's images is missing or cut (None: whole)."""
    try:
        whole_records(images / "inventory.img")
        entries = whole_records(images / "pstree.img")
    except FileNotFoundError as e:
        return f"{Path(str(e.filename)).name} is missing"
    except Torn as e:
        return str(e)
    if not entries:
        return "pstree.img names no process"
    for pattern in RECORDS_ONLY:
        for image in sorted(images.glob(pattern)):
            try:
                whole_records(image)
            except Torn as e:
                return str(e)
    for image in sorted(images.glob("ghost-file-*.img")):
        try:
            chunked_ghost(image)
        except Torn as e:
            return str(e)
    for entry in entries:
        pid = 0
        threads: list[int] = []
        for number, value in fields(entry):
            if number == 1 and isinstance(value, int):
                pid = value
            elif number == 5:
                threads += uints(value)
        why, state = _core(images, pid, pid)
        if why:
            return why
        if state == TASK_DEAD:
            # A zombie: CRIU restores it from its own core alone, and the
            # thread CRIU lists for it is no thread at all (an unset number).
            continue
        for tid in threads:
            if tid != pid and (why := _core(images, tid, pid)[0]):
                return why
    return None


def _core(images: Path, tid: int, pid: int) -> tuple[str | None, int | None]:
    """Is the core image of thread ``tid`` (of process ``pid``) whole, and
    its task's state (the process's own core holds it; None in a thread's)."""
    core = images / f"core-{tid}.img"
    try:
        entries = whole_records(core)
    except FileNotFoundError:
        named = "process" if tid == pid else "thread"
        return f"{core.name} is missing (pstree.img names {named} {tid})", None
    except Torn as e:
        return str(e), None
    if not entries:
        return f"{core.name} holds no record", None
    # CoreEntry.tc (3) is the task's TaskCoreEntry; its task_state (1).
    tc = next((v for n, v in fields(entries[0]) if n == 3 and isinstance(v, bytes)), b"")
    return None, next((v for n, v in fields(tc) if n == 1 and isinstance(v, int)), None)


def _pages(images: Path, page_size: int) -> str | None:
    """Does each page image hold exactly what its pagemaps say? (None: yes)."""
    present: dict[int, int] = defaultdict(int)
    for pagemap in sorted(images.glob("pagemap*.img")):
        try:
            head, *entries = whole_records(pagemap)
        except Torn as e:
            return str(e)
        except ValueError:
            return f"{pagemap.name} holds no header"
        pages_id = next((v for n, v in fields(head) if n == 1 and isinstance(v, int)), None)
        if pages_id is None:
            return f"{pagemap.name} names no page image"
        present[pages_id] += 0
        for entry in entries:
            f = {n: v for n, v in fields(entry) if isinstance(v, int)}
            # As CRIU reads an entry (criu/pagemap.c, init_pagemaps): the old
            # in_parent flag, no flags at all meaning present, and the old
            # 32-bit page count when the 64-bit one is absent.
            if f.get(3):
                flags = f.get(4, 0) | PE_PARENT
            else:
                flags = f.get(4, PE_PRESENT)
            if flags & PE_PRESENT:
                present[pages_id] += f.get(5, f.get(2, 0))
    for pages_id, n in sorted(present.items()):
        image = images / f"pages-{pages_id}.img"
        try:
            size = image.stat().st_size
        except FileNotFoundError:
            size = None
        if size != n * page_size:
            return (f"{image.name} holds {'no file' if size is None else f'{size} bytes'} "
                    f"where its pagemaps describe {n} pages ({n * page_size} bytes)")
    return None


def torn(images: Path, page_size: int | None = None) -> str | None:
    """What of the dump in ``images`` is missing or cut short, in words
    (None: it is whole). Reads headers only, never a page. The pre-dump it
    builds on (its ``parent`` link, inside the dump's work directory) is
    checked too: its pages are part of the same restore."""
    page_size = page_size or os.sysconf("SC_PAGE_SIZE")
    if why := _tree(images):
        return why
    work = images.resolve().parent
    directory = images
    for _ in range(MAX_PARENTS):
        if why := _pages(directory, page_size):
            return why if directory == images else f"{why} in its pre-dump {directory}"
        parent = directory / "parent"
        if not parent.is_dir() or not parent.resolve().is_relative_to(work):
            return None
        directory = parent.resolve()
    return None
