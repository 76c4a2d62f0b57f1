"""CRIU's image files, read without CRIU's protobuf definitions.

An image is a magic (two for most: the common one, then the image's own),
then records, each a little-endian u32 size and a protobuf message. The few
fields smr reads (link remaps, bound sockets) are picked by number from the
wire format: no generated code to keep in step with CRIU's .proto files.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

_COMMON_MAGICS = (0x54564319, 0x55105940)  # IMG_COMMON_MAGIC, IMG_SERVICE_MAGIC


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        if not b & 0x80:
            return n, i
        shift += 7


def fields(msg: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of a protobuf message: varints as int,
    length-delimited fields as bytes; fixed-width ones skipped."""
    i = 0
    while i < len(msg):
        key, i = _varint(msg, i)
        kind = key & 7
        if kind == 0:
            v, i = _varint(msg, i)
            yield key >> 3, v
        elif kind == 2:
            n, i = _varint(msg, i)
            yield key >> 3, msg[i:i + n]
            i += n
        elif kind in (1, 5):
            i += 8 if kind == 1 else 4
        else:
            raise ValueError(f"protobuf wire type {kind}")


def uints(value: int | bytes) -> list[int]:
    """A repeated varint field's value as ``fields`` gives it: one number,
    or a packed run of them."""
    if isinstance(value, int):
        return [value]
    out: list[int] = []
    i = 0
    while i < len(value):
        n, i = _varint(value, i)
        out.append(n)
    return out


class Torn(ValueError):
    """An image file whose last record runs past its end (or with no magic)."""


def whole_records(path: Path) -> list[bytes]:
    """Each record of one image file, read strictly: an empty file, or a
    record running past the file's end (a tail lost in a crash), raises
    Torn; a missing file, FileNotFoundError."""
    data = path.read_bytes()
    if len(data) < 4:
        raise Torn(f"{path.name} holds {len(data)} bytes, not even its magic")
    i = 8 if struct.unpack_from("<I", data)[0] in _COMMON_MAGICS else 4
    if i > len(data):
        raise Torn(f"{path.name} holds {len(data)} bytes, not even its magics")
    out: list[bytes] = []
    while i < len(data):
        if i + 4 > len(data):
            raise Torn(f"{path.name} ends inside a record's size, at byte {len(data)}")
        (n,) = struct.unpack_from("<I", data, i)
        if i + 4 + n > len(data):
            raise Torn(f"{path.name} ends at byte {len(data)}, inside a record of {n} bytes "
                       f"from byte {i + 4}")
        out.append(data[i + 4:i + 4 + n])
        i += 4 + n
    return out


def records(path: Path) -> Iterator[bytes]:
    """Each record of one image file; none if the dump made no such file."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    i = 8 if struct.unpack_from("<I", data)[0] in _COMMON_MAGICS else 4
    while i < len(data):
        (n,) = struct.unpack_from("<I", data, i)
        yield data[i + 4:i + 4 + n]
        i += 4 + n


def _record_at(f: BinaryIO, i: int, size: int, name: str) -> tuple[bytes, int]:
    """The record at byte ``i`` of an image file of ``size`` bytes, and where
    the next thing starts; Torn if the file ends inside it."""
    if i + 4 > size:
        raise Torn(f"{name} ends inside a record's size, at byte {size}")
    f.seek(i)
    (n,) = struct.unpack("<I", f.read(4))
    if i + 4 + n > size:
        raise Torn(f"{name} ends at byte {size}, inside a record of {n} bytes from byte {i + 4}")
    return f.read(n), i + 4 + n


def chunked_ghost(path: Path) -> None:
    """A ghost file's image (a deleted file the tree held open), read as CRIU
    restores it: its GhostFileEntry, then, when ``chunks`` (9) is set, each
    GhostChunkEntry (len 1, off 2) followed by ``len`` bytes of the file, to
    the image's end. Raises Torn where the image ends inside any of them, or
    a chunk lies past the file's recorded ``size`` (10); reads no file data.
    An image without chunks holds the file's bytes raw (CRIU checks their
    length against the file's entry itself)."""
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(4)
        if len(head) < 4:
            raise Torn(f"{path.name} holds {len(head)} bytes, not even its magic")
        i = 8 if struct.unpack("<I", head)[0] in _COMMON_MAGICS else 4
        entry, i = _record_at(f, i, size, path.name)
        ghost = {n: v for n, v in fields(entry) if isinstance(v, int)}
        if not ghost.get(9):
            return
        while i < size:
            record, i = _record_at(f, i, size, path.name)
            chunk = {n: v for n, v in fields(record) if isinstance(v, int)}
            length, offset = chunk.get(1, 0), chunk.get(2, 0)
            if i + length > size:
                raise Torn(f"{path.name} ends at byte {size}, inside a chunk of {length} bytes "
                           f"of the deleted file from byte {i}")
            if offset + length > ghost.get(10, 0):
                raise Torn(f"{path.name} holds a chunk at {offset}+{length}, past the deleted "
                           f"file's {ghost.get(10, 0)} bytes")
            i += length
