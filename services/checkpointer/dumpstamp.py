"""What a checkpoint step records of its dump so that recovery can judge it.

A stamp, taken as the dump starts under the job's (or container's) lock: the
dump sequence (``JobLock.sequence``) that orders generations by when they
were dumped (services/storage/order), the start time, and the boot id.

A dump's images are written by CRIU without fsync. A worker that died leaves
them whole in the page cache; a host that crashed may leave any of them torn
(writeback is not ordered across files, and dump.log, written last, may reach
the disk while a page image does not). So recovery trusts a finished dump
from this very boot, or one whose images were fsynced before its step said
so (``synced``), and refuses any other (``dump-unverified``). Either way it
first checks the images are whole (smr.process.wholedump: every page image
as long as its pagemaps say, the tree's images all there): a page image cut
short is refused even in the same boot, whatever cut it.

The fsync only lets a dump outlive a crash: refusing an unsynced one is safe
without it. So it waits SYNC_AFTER_S from the dump's end: a commit done by
then (most are) pays nothing, its files deleted before they were ever
written back; a longer one finds most of its images on disk already (the
kernel writes dirty pages back after vm.dirty_expire_centisecs, 30 s by
default), and the fsync then writes little beside the upload. A step that
stops with a finished dump (``smr up`` stopping, a rollout) fsyncs at once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from smr.contract.errors import PermanentError
from smr.contract.messages import now
from smr.identity import boot_id, booted_at
from smr.jobs import JobLock
from smr.process.wholedump import torn

SYNC_AFTER_S = 30.0


async def take(lock: JobLock, key: str, request_id: str) -> dict[str, Any]:
    """The stamp of a dump about to start, under the lock ``key`` we hold.
    The bucket's epoch is read before the sequence: a bucket made again in
    between holds no lock of ours, and ``sequence`` refuses (lock-lost), so
    a sequence is never stamped with another bucket's epoch."""
    epoch = await lock.epoch()
    return {"seq": await lock.sequence(key, request_id), "lock_epoch": epoch,
            "started_at": now(), "boot_id": boot_id()}


def sync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (links are not followed)."""
    for parent, _dirs, files in os.walk(root):
        for name in files:
            p = os.path.join(parent, name)
            if os.path.islink(p):
                continue
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def check_trusted(stamp: dict[str, Any] | None, synced: bool, images: Path, what: str,
                  latest_hint: str) -> None:
    """Refuse (``dump-unverified``) a finished dump in ``images`` that a host
    crash may have torn: one whose images are not whole, or one taken in an
    earlier boot and not fsynced. A dump with no stamp (an older smr's,
    upgraded in place) is judged by when CRIU wrote its log. The caller
    drops a refused dump: ``latest`` never moves to it."""
    if why := torn(images):
        raise PermanentError(
            f"the dump of {what} on disk is not whole ({why}): a crash cut it short before it "
            "reached the disk; it was not stored", code="dump-unverified", hint=latest_hint)
    if synced:
        return
    dumped_in = (stamp or {}).get("boot_id")
    if dumped_in and dumped_in == boot_id():
        return  # the same boot: whatever CRIU wrote is there, in the page cache if not on disk
    if not dumped_in:
        try:
            if (images / "dump.log").stat().st_mtime >= booted_at():
                return
        except OSError:
            pass
    raise PermanentError(
        f"the dump of {what} on disk was taken before the host restarted "
        f"(boot {dumped_in or 'unknown'}) and was not yet on disk (never fsynced): a crash "
        "may have torn its images; it was not stored", code="dump-unverified",
        hint=latest_hint)
