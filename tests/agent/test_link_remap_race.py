"""A sidecar of the pod (it shares the pod's /dev/shm, and is never frozen
by the dump) swaps CRIU's link remap /dev/shm/link_remap.N for a directory
between the agent's check and its unlink (services/checkpointer/pod_dump.py,
_drop_link_remaps): the heartbeat's tree must still be continued."""

from __future__ import annotations

import os
import random
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest

from services.checkpointer import pod_dump
from smr.process import linkremap

SHM = Path("/dev/shm")


class _Run:
    seconds = 0.1


class _Criu:
    async def dump(self, *a: Any, **kw: Any) -> _Run:
        return _Run()


class _Shim:
    pid = os.getpid()  # Root.of_pid: this process's root, the host's /dev/shm

    def workload(self) -> None:
        return None


class _C:
    def target(self) -> str:
        return "default/p/main"


async def test_a_link_remap_swapped_for_a_directory_after_its_check_still_continues_the_tree(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    name = f"link_remap.{random.randrange(10**9, 10**10)}"
    link = SHM / name
    link.write_bytes(b"x")
    real_stat = os.stat

    def racing_stat(path: Any, *a: Any, **kw: Any) -> os.stat_result:
        st = real_stat(path, *a, **kw)
        if path == name and kw.get("dir_fd") is not None and link.is_file():
            # the sidecar, between the agent's stat and its unlink
            link.unlink()
            link.mkdir()
        return st

    continued: list[int] = []
    monkeypatch.setattr(pod_dump.linkremap, "linked",
                        lambda images: [(f"{linkremap.SHM}/{name}", "/dev/shm/sem.x")])
    monkeypatch.setattr(pod_dump, "_note_link_names", lambda *a: None)

    async def no_capture(*a: Any) -> None:
        monkeypatch.setattr(os, "stat", racing_stat)

    monkeypatch.setattr(pod_dump, "capture", no_capture)
    monkeypatch.setattr(pod_dump, "signal_tree",
                        lambda pid, sig: continued.append(sig) if sig == signal.SIGCONT else None)
    try:
        try:
            await pod_dump.dump_tree(_C(), _Shim(), _Criu(), 4242, 7, tmp_path, tmp_path,  # type: ignore[arg-type]
                                     True, "keep", None)  # type: ignore[arg-type]
            error = None
        except BaseException as e:
            error = e
        finally:
            monkeypatch.setattr(os, "stat", real_stat)
        assert continued == [signal.SIGCONT] and error is None, (
            f"a heartbeat's dump whose link remap a sidecar swapped for a directory "
            f"raised {error!r} and continued its tree {continued} times: the pod's "
            "workload stays stopped for good")
    finally:
        if link.is_dir():
            shutil.rmtree(link)
        elif link.exists():
            link.unlink()
