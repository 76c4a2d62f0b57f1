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
