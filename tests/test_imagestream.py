"""The image-streamer wire format (criu/img-streamer.c), at its edges; the
protocol itself runs against real CRIU in every restore test."""

from __future__ import annotations

import pytest

from smr.process.imagestream import StreamerError, decode_request, encode_reply


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
