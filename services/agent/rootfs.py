"""What a container wrote to its writable layer, saved with its checkpoint
and put back into the replacement container before the restore.

Saved: the overlayfs upperdir as a tar (files, directories, symlinks; an
overlay whiteout, a 0:0 character device, records a deleted file). Put back:
*through* the new container's root file system, by a helper chrooted into
it, so a symlink the workload planted cannot point a write at the host.
"""

from __future__ import annotations

import asyncio
import os
import stat
import sys
import tarfile
from pathlib import Path

from smr.errors import PermanentError

TAR = "rootfs.tar"
# Written by CRIU or the kubelet, not the workload's state.
_SKIP = {"smr", "etc/hosts", "etc/hostname", "etc/resolv.conf", "dev", "proc", "sys"}


def _capture(upper: Path, out: Path) -> None:
    with tarfile.open(out, "w") as tar:
        for dirpath, dirnames, filenames in os.walk(upper):
            rel_dir = os.path.relpath(dirpath, upper)
            for name in sorted(dirnames + filenames):
                rel = os.path.normpath(os.path.join(rel_dir, name))
                if rel in _SKIP or rel.split("/", 1)[0] in _SKIP:
                    continue
                path = os.path.join(dirpath, name)
                st = os.lstat(path)
                if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                    info = tarfile.TarInfo(rel)
                    info.type = tarfile.CHRTYPE  # whiteout: deleted in this layer
                    tar.addfile(info)
                elif stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode) \
                        or stat.S_ISLNK(st.st_mode):
                    tar.add(path, arcname=rel, recursive=False)
            dirnames[:] = [d for d in dirnames if os.path.normpath(
                os.path.join(rel_dir, d)).split("/", 1)[0] not in _SKIP]


async def capture(upper: Path, out: Path) -> None:
    """Tar ``upper`` (the container's writable layer) into ``out``."""
    if not upper.is_dir():
        raise PermanentError(f"the container's writable layer {upper} is not readable",
                             code="rootfs-unreadable",
                             hint="the agent needs the container runtime's state directory "
                                  "(/var/lib/containerd) mounted")
    await asyncio.to_thread(_capture, upper, out)


# Runs in a child chrooted into the container: deletions first, then the files.
_APPLY = r"""
import os, sys, tarfile, shutil
root = sys.argv[1]
tar = tarfile.open(fileobj=sys.stdin.buffer, mode="r|")
os.chroot(root)
os.chdir("/")
for m in tar:
    path = "/" + m.name
    if m.type == tarfile.CHRTYPE:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.lexists(path):
            os.unlink(path)
        continue
    tar.extract(m, "/", set_attrs=True, filter="fully_trusted")
"""


async def apply(tar: Path, root: Path) -> None:
    """Put the saved layer back into the container whose root is ``root``."""
    if not tar.is_file():
        return  # a checkpoint without a layer (nothing was written)
    with open(tar, "rb") as src:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _APPLY, str(root), stdin=src,
            stderr=asyncio.subprocess.PIPE)
        _, err = await proc.communicate()
    if proc.returncode != 0:
        raise PermanentError(
            "could not put the checkpoint's writable layer back into the container",
            code="rootfs-restore-failed", detail=err.decode(errors="replace")[-500:])
