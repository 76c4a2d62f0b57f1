"""What a checkpoint generation is, the errors of reading one, and what
makes a manifest refused (a path outside the restore) before anything is written."""

from __future__ import annotations

import contextlib
import errno
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from smr.contract.errors import PermanentError, TemporaryError
from smr.contract.messages import epoch

log = logging.getLogger("smr.storage")


class CheckpointNotFound(PermanentError):
    code = "checkpoint-not-found"


class ScratchFull(TemporaryError):
    code = "scratch-full"


class CheckpointCorrupt(PermanentError):
    code = "checkpoint-corrupt"


class Unencrypted(PermanentError):
    code = "checkpoint-not-encrypted"


@dataclass(frozen=True)
class Generation:
    manifest: dict[str, Any]
    location: str

    @property
    def number(self) -> int:
        return int(self.manifest["generation"])

    @property
    def size_bytes(self) -> int:
        return int(self.manifest["size_bytes"])


@contextlib.contextmanager
def listed() -> Iterator[None]:
    """For listings: a generation retired since the listing, or torn, is not
    one; a corrupt manifest is left out (and logged), not fatal to the list."""
    try:
        yield
    except CheckpointNotFound:
        pass
    except CheckpointCorrupt as e:
        log.error("left out of the listing: %s", e.message)


def check_paths(m: dict[str, Any]) -> None:
    """Refuse a manifest whose files or links would be written outside the
    directory it is restored into (by root): every path plain and relative,
    none under a link, and every link's target inside, through no link."""
    where = f"the manifest of {m.get('checkpoint_id')} generation {m.get('generation')}"
    links = {link["path"] for link in m.get("symlinks", [])}

    def bad(what: str) -> CheckpointCorrupt:
        return CheckpointCorrupt(f"{where} {what}; nothing was restored from it",
                                 hint="the manifest was altered: restore another generation "
                                      "(--generation N)")

    seen: set[str] = set()
    for p in [f["path"] for f in m["files"]] + [link["path"] for link in m.get("symlinks", [])]:
        parts = p.split("/")
        if "\0" in p or any(c in ("", ".", "..") for c in parts):
            raise bad(f"names {p!r}, which is not a plain relative path")
        if p in seen:
            raise bad(f"names {p!r} twice")
        seen.add(p)
        if any("/".join(parts[:i]) in links for i in range(1, len(parts))):
            raise bad(f"puts {p!r} under a symlink")
    for link in m.get("symlinks", []):
        target = link["target"]
        if target.startswith("/") or "\0" in target:
            raise bad(f"links {link['path']!r} to {target!r}, outside the restore")
        at = link["path"].split("/")[:-1]
        for c in target.split("/"):
            if c in ("", "."):
                continue
            if c == "..":
                if not at:
                    raise bad(f"links {link['path']!r} to {target!r}, outside the restore")
                at.pop()
                continue
            at.append(c)
            if "/".join(at) in links:
                raise bad(f"links {link['path']!r} to {target!r}, through another link")


def created_epoch(g: Generation) -> float:
    return epoch(g.manifest["created_at"])


def streamable(manifest: dict[str, Any]) -> bool:
    """Can CRIU restore this generation from a stream? Not an incremental
    dump: its images link to a parent directory that CRIU reads by path."""
    return not manifest.get("symlinks")


SPACE_HINT = ("free space there, or point SMR_WORK_DIR (SMR_DATA_DIR for pods) at a larger "
              "disk; the restore is retried")


def out_of_space(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
