"""CRIU's image files, read without CRIU's protobuf definitions.

An image is a magic (two for most: the common one, then the image's own),
then records, each a little-endian u32 size and a protobuf message. The few
fields smr reads (link remaps, bound sockets) are picked by number from the
wire format: no generated code to keep in step with CRIU's .proto files.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

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
