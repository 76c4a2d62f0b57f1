"""A STREAMED pod restore (``criu restore --stream``, fed by
smr.process.imagestream) cancelled while CRIU runs, at each point of the
stream: CRIU must end promptly (the streamer hangs up its pipes and socket),
and the redelivered request's recovery must then adopt a tree that came back,
or restore once where none did; never twice, never a tree on short images.
Real containerd, runc, CRIU, nats-server and moto (tests/agent/cluster.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from services.restorer import launcher
from services.restorer import stream as stream_module
from smr.process import imagestream, unstop
from smr.process.criu import Criu
from smr.process.imagestream import FileRange
from tests.agent.cluster import Cluster, workload
from tests.agent.test_data_path_attacks import (
    agents_criu_restoring,
    restored_pod,
    restoring_shim,
)


def _half(chunk: Any) -> Any:
    if isinstance(chunk, FileRange):
        return FileRange(chunk.fd, chunk.offset, max(1, chunk.length // 2))
    return bytes(chunk)[:max(1, len(chunk) // 2)]


# mid-image: the cancelled CRIU had made the tree's root (its checkpointed
# PID) before it failed on the short image and killed it; smr-init, waiting,
# reaps that root into its early exits, and the second restore brings the
# tree back under the same PID. smr-init took that old exit for the restored
# root's and ended the container after the tree ran a step (about half the
# runs), until it came to count an early exit only for a PID no process holds.
@pytest.mark.parametrize("point", ["waiting-for-an-image", "mid-image",
                                   "after-a-whole-page-image", "after-the-last-image",
                                   "mid-image-criu-stopped-for-good"])
async def test_a_streamed_pod_restore_cancelled_mid_criu_ends_criu_and_restores_once(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch, point: str) -> None:
    _, b, env, before = await restored_pod(cluster, f"s{point[:5]}")
    reached = threading.Event()  # the stream is at ``point`` (the first restore only)
    first = [True]
    stopped: list[int] = []  # after-the-last-image: the CRIU held stopped
    restores = 0
    waits: list[tuple[bool, float, list[int]]] = []  # gone, seconds, CRIU left
    real_images = stream_module.StreamedImages
    real_criu = Criu.restore
    real_wait = launcher.wait_exit
    real_recv = imagestream._recv_exact

    class Held:
        def __init__(self, *a: Any, **kw: Any) -> None:
            self.inner = real_images(*a, **kw)
            self.held = first[0]

        def __call__(self, name: str) -> AsyncIterator[Any] | None:
            it = self.inner(name)
            if it is None or not self.held:
                return it
            if point == "waiting-for-an-image" and name == "inventory.img":
                return self._hold(it, 0)
            if point.startswith("mid-image") and name.startswith("pages-"):
                return self._hold(it, 1)
            if point == "after-a-whole-page-image" and name.startswith("pages-"):
                return self._stop_after(it)
            return it

        async def _stop_after(self, it: AsyncIterator[Any]) -> AsyncIterator[Any]:
            # Asked for more once the last chunk is in CRIU's pipe (the
            # writer writes each before it asks for the next): CRIU is
            # held stopped there, every byte of this image given.
            self.held = False
            async for chunk in it:
                yield chunk
            pids = _criu_restoring()
            top = [p for p in pids if _ppid(p) not in pids]
            for p in top:
                os.kill(p, signal.SIGSTOP)
            stopped.extend(top)
            reached.set()

        async def _hold(self, it: AsyncIterator[Any], halves: int) -> AsyncIterator[Any]:
            self.held = False
            async for chunk in it:
                if halves:
                    yield _half(chunk)
                break
            if point == "mid-image-criu-stopped-for-good":
                # A tenant's kill -STOP of the agent's CRIU (it runs in the
                # container's PID namespace), never continued.
                pids = _criu_restoring()
                top = [p for p in pids if _ppid(p) not in pids]
                for p in top:
                    os.kill(p, signal.SIGSTOP)
                stopped.extend(top)
            reached.set()
            await asyncio.Event().wait()

        async def aclose(self) -> None:
            await self.inner.aclose()

    crius: list[int] = []  # after-the-last-image: CRIU's, at its first request

    def hung_up(conn: Any, n: int) -> bytes | None:
        if n == 4 and point == "after-the-last-image" and first[0] and not crius:
            # CRIU's first request: it runs. Its launcher (nsenter, CRIU's
            # parent), which only waits for it, is held stopped now, so that
            # the step cannot see the run end however soon CRIU exits after its
            # last image (it closes the socket once the tree runs, its last act
            # before it exits); CRIU's own processes are stopped at that close,
            # with no /proc scan then.
            crius.extend(_criu_restoring())
            top = [p for p in crius if _ppid(p) not in crius]
            if top:
                os.kill(_ppid(top[0]), signal.SIGSTOP)
                stopped.append(_ppid(top[0]))
        got = real_recv(conn, n)
        if got is None and n == 4 and point == "after-the-last-image" and first[0]:
            # CRIU closed its streamer socket: it has every image. Held
            # stopped, so that the redelivery finds its run still there.
            for p in crius:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGSTOP)
            stopped.extend(crius)
            reached.set()
        return got

    def go_on() -> None:
        for p in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGCONT)

    async def waited(launcher: int, ticks: int, timeout: float) -> bool:
        if stopped and point != "mid-image-criu-stopped-for-good":
            # Continued as a tenant would: CRIU, in its reach; not nsenter.
            asyncio.get_running_loop().call_later(5, go_on)
        t = time.monotonic()
        gone = await real_wait(launcher, ticks, min(timeout, 30.0))
        shim = await restoring_shim(b)
        left: list[int] = []
        with contextlib.suppress(OSError):
            left = agents_criu_restoring(shim.pid)
        waits.append((gone, time.monotonic() - t, left))
        return gone

    async def cancelled_at_point(run: Any) -> Any:
        nonlocal restores
        restores += 1
        inner = asyncio.ensure_future(run)
        if first[0]:
            task = asyncio.current_task()
            assert task is not None
            for _ in range(3000):
                if reached.is_set() or inner.done():
                    break
                await asyncio.sleep(0.01)
            first[0] = False
            assert reached.is_set(), f"the stream never reached {point}: {inner}"
            inner.cancel()
            await asyncio.wait([inner])
            task.cancel()  # the agent's stop reaches the step
            await asyncio.sleep(0)
        return await inner

    async def never(*a: Any, **kw: Any) -> None:
        await asyncio.Event().wait()

    monkeypatch.setattr(stream_module, "StreamedImages", Held)
    monkeypatch.setattr(imagestream, "_recv_exact", hung_up)
    monkeypatch.setattr(launcher, "wait_exit", waited)
    # Not continued by the step's own watch in the moment before its cancel.
    monkeypatch.setattr(unstop, "keep_running", never)
    monkeypatch.setattr(Criu, "restore", lambda self, *a, **kw: cancelled_at_point(
        real_criu(self, *a, **kw)))
    cluster.kube.put("pods", workload("cx-2", b, env=env, owner="cx", restart="Never"))
    try:
        after = await cluster.until_steps("cx-2", b, 5, timeout=120)
        for _ in range(900):  # the redelivery's recovery (after stale_after)
            if waits or restores > 1:
                break
            await asyncio.sleep(0.1)
    finally:
        go_on()
    assert not first[0], "the restore was never cancelled: the test proves nothing"
    assert waits, "no recovery waited for the cancelled step's CRIU"
    gone, seconds, left = waits[0]
    assert gone and not left, (
        f"the recovery's wait for the cancelled step's CRIU (by its launcher, nsenter) "
        f"ended after {seconds:.1f} s with it still there (CRIU processes restoring: {left}; "
        f"stopped by someone else: {stopped})")
    assert after[0][0] == before[-1][0] + 1, (
        f"not resumed once from step {before[-1][0]}: {after[:3]}")
    numbers = [s[0] for s in after]
    assert numbers == sorted(set(numbers)), f"two copies ran in the container: {numbers[:20]}"
    # A CRIU that came back with the tree is adopted; one that failed on
    # its hung-up images is restored once more.
    if point.startswith(("waiting-for-an-image", "mid-image")):
        assert restores == 2, f"CRIU restores begun: {restores}, expected 2"
    elif point == "after-the-last-image":
        assert restores == 1, f"CRIU restores begun: {restores}, expected 1"
    else:  # CRIU may need more of the stream after that image, or not
        assert restores in (1, 2), f"CRIU restores begun: {restores}"


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _criu_restoring() -> list[int]:
    """The agent's CRIU restoring (one restore at a time here)."""
    found = []
    for p in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            if p.isdigit():
                argv = open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")
                if argv[0].startswith(b"/proc/self/fd/") and b"restore" in argv:
                    found.append(int(p))
    return found
