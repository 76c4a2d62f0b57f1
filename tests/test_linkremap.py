"""smr.process.linkremap puts CRIU's links back in the host's /dev/shm, which every
user writes to: it follows no link there and takes no name that is not its
own. (The migrations themselves: tests/test_spawn_semaphore.py.)"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import orjson
import pytest

from smr.contract.errors import TemporaryError
from smr.process import linkremap

SHM = Path(linkremap.SHM)


def carry_of(tmp_path: Path, link: str, names: list[str], uid: int = 65534) -> Path:
    carry = tmp_path / linkremap.CARRY
    carry.mkdir(parents=True)
    (carry / link).write_bytes(b"dumped")
    (carry / linkremap.RECORDS).write_bytes(orjson.dumps([{
        "link": link, "deleted": "/dev/shm/sem.Xyz123", "uid": uid, "gid": uid,
        "mode": 0o600, "dev": 0, "ino": 0, "names": names}]))
    return carry


@pytest.fixture
def unique() -> str:
    return uuid.uuid4().hex[:8]


async def test_the_link_and_the_names_are_the_copy_and_go_after(tmp_path: Path,
                                                                unique: str) -> None:
    link, name = f"link_remap.9{int(unique, 16)}", f"sem.mp-{unique}"
    try:
        async with linkremap.put_back(carry_of(tmp_path, link, [name])):
            made = (SHM / link).stat()
            assert (SHM / link).read_bytes() == b"dumped" and made.st_uid == 65534
            assert (SHM / name).stat().st_ino == made.st_ino  # a later sem_open shares it
        assert not (SHM / link).exists()  # nothing left for another restore to find
        assert (SHM / name).exists()  # the job's name, as sem_open left it
    finally:
        for n in (link, name):
            (SHM / n).unlink(missing_ok=True)


async def test_a_tenant_link_or_file_in_the_way_is_neither_followed_nor_taken(
        tmp_path: Path, unique: str) -> None:
    link, name = f"link_remap.9{int(unique, 16)}", f"sem.mp-{unique}"
    target = tmp_path / "victim"
    target.write_bytes(b"victim")
    try:
        (SHM / name).symlink_to(target)  # a tenant's link under the semaphore's name
        async with linkremap.put_back(carry_of(tmp_path, link, [name])):
            assert (SHM / name).is_symlink() and target.read_bytes() == b"victim"
        (SHM / link).write_bytes(b"theirs")  # a file under the link's name
        with pytest.raises(TemporaryError) as e:
            async with linkremap.put_back(carry_of(tmp_path / "2", link, [name])):
                pass
        assert e.value.code == "link-remap-taken"
        assert (SHM / link).read_bytes() == b"theirs"
    finally:
        for n in (link, name):
            (SHM / n).unlink(missing_ok=True)
    assert not os.path.lexists(SHM / link)


async def test_a_name_out_of_dev_shm_in_the_checkpoint_is_refused(tmp_path: Path,
                                                                  unique: str) -> None:
    link = f"link_remap.9{int(unique, 16)}"
    outside = tmp_path / "outside"
    with pytest.raises(linkremap.LinkRemapError):
        async with linkremap.put_back(carry_of(tmp_path, link, [f"../..{outside}"])):
            pass
    assert not outside.exists() and not os.path.lexists(SHM / link)
