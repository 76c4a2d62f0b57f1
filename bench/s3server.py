"""moto's S3 server (an S3-compatible server over HTTP, what the tests use),
with ranged GETs read from the object's file instead of a copy of the whole
object per request.

moto 5 answers a ranged GET by reading the whole object, copying it, then
slicing the range out: a restore reading a 6 GiB page image in 8 MiB ranges
would copy 6 GiB eight hundred times. This patch hands moto's range handling
a view that reads only the range asked for (under the key's lock, from its
spooled file); everything else is moto's own. For the benches only.

    python3 bench/s3server.py -H 127.0.0.1 -p PORT
"""

from __future__ import annotations

import sys
import threading
from typing import Any


class _Ranges:
    """What moto's range handling needs of a body: its length and slices."""

    def __init__(self, key: Any) -> None:
        self.key = key

    def __len__(self) -> int:
        return int(self.key.size)

    def __bool__(self) -> bool:
        return self.key.size > 0

    def __getitem__(self, s: slice) -> bytes:
        start, stop, _ = s.indices(len(self))
        with self.key.lock:
            buf = self.key._value_buffer
            buf.seek(start)
            return bytes(buf.read(stop - start))


def patch() -> None:
    from moto.s3 import models, responses

    reading: dict[int, Any] = {}  # thread → the key its ranged GET reads
    plain = models.FakeKey.value

    def value(key: Any) -> Any:
        if reading.get(threading.get_ident()) is key:
            return _Ranges(key)
        return plain.fget(key)

    models.FakeKey.value = property(value, plain.fset)  # type: ignore[assignment,method-assign]
    original = responses.S3Response.get_object

    def get_object(self: Any) -> Any:
        if not self.headers.get("range") or self._get_int_param("partNumber"):
            return original(self)
        key, _ = self._get_key()
        reading[threading.get_ident()] = key
        try:
            return original(self)
        finally:
            reading.pop(threading.get_ident(), None)

    responses.S3Response.get_object = get_object  # type: ignore[method-assign]


if __name__ == "__main__":
    patch()
    from moto.server import main

    sys.exit(main(sys.argv[1:]))
