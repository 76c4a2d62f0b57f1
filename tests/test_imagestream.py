"""The image-streamer wire format (criu/img-streamer.c), at its edges; the
protocol itself runs against real CRIU in every restore test."""

from __future__ import annotations

import asyncio
import os
import select
import socket
import struct
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from smr.process.imagestream import (
    SOCKET,
    ImageStreamer,
    StreamerError,
    decode_request,
    encode_reply,
)


def test_a_name_longer_than_one_varint_byte_decodes() -> None:
    name = "pages-" + "7" * 294 + ".img"  # 304 bytes: length 0xb0 0x02
    assert decode_request(b"\x0a\xb0\x02" + name.encode()) == name


def test_replies_are_length_prefixed_booleans() -> None:
    assert encode_reply(True) == b"\x02\x00\x00\x00\x08\x01"
    assert encode_reply(False) == b"\x02\x00\x00\x00\x08\x00"


@pytest.mark.parametrize("body", [b"", b"\x08\x01", b"\x0a\x05abc", b"\x0a\x80"])
def test_anything_else_is_refused_by_name(body: bytes) -> None:
    with pytest.raises(StreamerError):
        decode_request(body)


class _CancelledOnArrival(list):  # type: ignore[type-arg]
    """The streamer's writers, each cancelled as it is added: before it ever
    runs, as a step's cancel can land between a writer's creation and its
    first step."""

    def append(self, task: asyncio.Task[None]) -> None:
        task.cancel()
        super().append(task)


def _criu_asks_for(images: Path, name: str) -> int:
    """CRIU's side (criu/img-streamer.c): ask for ``name``, send the write end
    of a pipe, keep the read end (returned)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(images / SOCKET))
        body = b"\x0a" + bytes([len(name)]) + name.encode()
        s.sendall(struct.pack("<I", len(body)) + body)
        assert s.recv(6) == encode_reply(True)
        r, w = os.pipe()
        socket.send_fds(s, [b"\0"], [w])
        os.close(w)
        time.sleep(0.5)  # the streamer's turn, before this end hangs up
    return r


async def test_a_writer_cancelled_before_it_ran_still_hangs_up_crius_pipe(
        tmp_path: Path) -> None:
    """Otherwise CRIU waits on that image for ever, beside the recovery that
    finds it still running."""

    async def forever() -> AsyncIterator[bytes]:
        await asyncio.Event().wait()
        yield b""

    streamer = ImageStreamer(tmp_path, lambda name: forever())
    streamer._writers = _CancelledOnArrival()
    async with streamer:
        r = await asyncio.to_thread(_criu_asks_for, tmp_path, "pages-1.img")
        await asyncio.sleep(0.2)
        try:
            # poll, not select: this process may hold descriptors past 1024.
            watch = select.poll()
            watch.register(r, select.POLLIN | select.POLLHUP)
            ready = await asyncio.to_thread(watch.poll, 5000)
            assert ready and os.read(r, 1) == b"", (
                "CRIU's pipe for pages-1.img stays open after its writer was cancelled")
        finally:
            os.close(r)


async def test_an_image_criu_stopped_reading_fails_nothing_after_criu_succeeded(
        tmp_path: Path) -> None:
    """CRIU may close an image's pipe once it has what it needs: the write's
    broken pipe is no reason to fail a restore CRIU reported good (its tree
    runs by then); a source's own error still is."""

    async def plenty() -> AsyncIterator[bytes]:
        for _ in range(24):  # more than the pipe holds (16 MiB): a write meets the close
            yield b"x" * (1 << 20)

    async with ImageStreamer(tmp_path, lambda name: plenty()) as streamer:
        r = await asyncio.to_thread(_criu_asks_for, tmp_path, "core-1.img")
        os.close(r)  # read nothing of it, as CRIU done with an image
        await asyncio.sleep(0.2)
        await streamer.finish()
    assert streamer.served == ["core-1.img"]
    assert isinstance(streamer._errors[0], BrokenPipeError), streamer._errors


async def test_bytes_criu_took_before_it_closed_an_image_are_still_verified(
        tmp_path: Path) -> None:
    """A source hands a file's bytes on before the file's sha256 is known
    (services/storage/download holds back only the last range). CRIU that
    read some of them and closed the pipe has used bytes no one verified:
    the rest of the source is still read, so that a mismatch (a corrupt
    object) fails the restore rather than passing for "CRIU had enough"."""

    class Mismatch(Exception):
        pass

    async def corrupt() -> AsyncIterator[bytes]:
        for _ in range(24):  # more than the pipe holds (16 MiB): a write meets the close
            yield b"x" * (1 << 20)
        raise Mismatch("sha256 differs")  # the held-back last range never comes

    async with ImageStreamer(tmp_path, lambda name: corrupt()) as streamer:
        r = await asyncio.to_thread(_criu_asks_for, tmp_path, "pages-1.img")
        os.read(r, 1 << 20)  # CRIU used the first bytes, then was done with the image
        os.close(r)
        with pytest.raises(Mismatch):
            await streamer.finish()
