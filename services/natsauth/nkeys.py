"""NATS nkeys and the JWTs nats-server's auth callout speaks (ADR-26), on
``cryptography``'s Ed25519 (no nkeys/PyNaCl dependency for a few lines).

An nkey is base32 (no padding) of a prefix byte naming its kind, the 32-byte
Ed25519 key, and a CRC-16/XMODEM of both (little-endian). A seed has two
prefix bytes: the seed prefix, then the kind. A JWT is ``header.claims.sig``
in unpadded base64url, signed with Ed25519 (``alg: ed25519-nkey``).
"""

from __future__ import annotations

import base64
import hashlib
import time
from typing import Any

import orjson
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

PREFIX_SEED = 18 << 3  # 'S'
PREFIX = {"account": 0, "server": 13 << 3, "user": 20 << 3}  # 'A', 'N', 'U'
HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}


def _crc16(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def _b32(raw: bytes) -> str:
    return base64.b32encode(raw + _crc16(raw).to_bytes(2, "little")).decode().rstrip("=")


def _unb32(text: str) -> bytes:
    raw = base64.b32decode(text + "=" * (-len(text) % 8))
    body, crc = raw[:-2], int.from_bytes(raw[-2:], "little")
    if _crc16(body) != crc:
        raise ValueError("nkey checksum mismatch")
    return body


def public_key(kind: str, raw: bytes) -> str:
    return _b32(bytes([PREFIX[kind]]) + raw)


def decode_public(kind: str, text: str) -> bytes:
    body = _unb32(text)
    if body[0] != PREFIX[kind] or len(body) != 33:
        raise ValueError(f"not a {kind} public nkey: {text[:4]}...")
    return body[1:]


class KeyPair:
    """An nkey pair of one ``kind`` (account, server, user)."""

    def __init__(self, kind: str, private: Ed25519PrivateKey) -> None:
        self.kind, self._private = kind, private

    @classmethod
    def generate(cls, kind: str) -> KeyPair:
        return cls(kind, Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: str) -> KeyPair:
        body = _unb32(seed.strip())
        if len(body) != 34 or body[0] & 0xF8 != PREFIX_SEED:
            raise ValueError("not an nkey seed")
        kind_byte = ((body[0] & 7) << 5) | ((body[1] & 0xF8) >> 3)
        kind = next(k for k, v in PREFIX.items() if v == kind_byte)
        return cls(kind, Ed25519PrivateKey.from_private_bytes(body[2:]))

    @property
    def seed(self) -> str:
        raw = self._private.private_bytes_raw()
        p = PREFIX[self.kind]
        return _b32(bytes([PREFIX_SEED | p >> 5, (p & 31) << 3]) + raw)

    @property
    def public(self) -> str:
        return public_key(self.kind, self._private.public_key().public_bytes(
            Encoding.Raw, PublicFormat.Raw))

    def sign(self, data: bytes) -> bytes:
        return self._private.sign(data)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def encode_jwt(claims: dict[str, Any], signer: KeyPair) -> str:
    claims = {**claims, "iss": signer.public, "iat": claims.get("iat", int(time.time()))}
    claims["jti"] = ""
    claims["jti"] = base64.b32encode(hashlib.sha256(orjson.dumps(claims)).digest()
                                     ).decode().rstrip("=")
    signing = f"{_b64(orjson.dumps(HEADER))}.{_b64(orjson.dumps(claims))}"
    return f"{signing}.{_b64(signer.sign(signing.encode()))}"


def decode_jwt(token: str, issuer_kind: str) -> dict[str, Any]:
    """The claims of ``token``, whose signature must be its ``iss``'s (an nkey
    of ``issuer_kind``): ValueError otherwise."""
    try:
        head, body, sig = token.strip().split(".")
        claims: dict[str, Any] = orjson.loads(_unb64(body))
        if orjson.loads(_unb64(head)).get("alg") != HEADER["alg"]:
            raise ValueError("not an ed25519-nkey JWT")
        key = Ed25519PublicKey.from_public_bytes(decode_public(issuer_kind, claims["iss"]))
        key.verify(_unb64(sig), f"{head}.{body}".encode())
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(f"invalid JWT: {type(e).__name__}: {e}") from None
    return claims
