"""How one frame of a stored file is encoded: zstd, then AES-256-GCM.

Files are cut into frames of at most ``FRAME_SIZE`` raw bytes, each encoded on
its own, so frames can be compressed in parallel, uploaded while CRIU is still
writing, and fetched with parallel ranged GETs. A frame that zstd does not
shrink is stored as it is (random memory costs no extra bytes).

Encrypted frames are ``nonce (12) || ciphertext || tag (16)``; the associated
data binds each frame to its object key and index, so frames cannot be swapped
or replayed between files. The manifest records the key's id (a fingerprint),
never the key.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import zstandard
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from smr.errors import ConfigError, PermanentError

FRAME_SIZE = 8 << 20
NONCE = 12
ALGORITHM = "AES-256-GCM"


class DecodeError(PermanentError):
    code = "checkpoint-corrupt"


class WrongKey(PermanentError):
    code = "wrong-encryption-key"


def key_id(key: bytes) -> str:
    """A fingerprint that names a key without revealing it."""
    return hashlib.sha256(b"smr-key-id:" + key).hexdigest()[:16]


def load_key(value: str, file: str) -> bytes | None:
    """The encryption key from SMR_ENCRYPTION_KEY (base64) or a file holding it
    (a mounted Kubernetes Secret); None when neither is set."""
    src = "SMR_ENCRYPTION_KEY"
    if file:
        src = f"SMR_ENCRYPTION_KEY_FILE={file}"
        try:
            value = Path(file).read_text().strip()
        except OSError as e:
            raise ConfigError(f"cannot read the encryption key: {src}: {e}",
                              hint="mount the Secret there, or unset the setting") from None
    if not value:
        return None
    try:
        key = base64.b64decode(value, validate=True)
    except binascii.Error:
        key = b""
    if len(key) != 32:
        raise ConfigError(f"{src} is not a base64-encoded 32-byte key",
                          hint="create one with: head -c 32 /dev/urandom | base64")
    return key


PROBES = 4
PROBE_SIZE = 16 << 10


def worth_compressing(raw: bytes) -> bool:
    """Does any of a few samples of the frame shrink by 5 % at zstd's fastest
    level? Random memory (weights, encrypted or compressed data) does not,
    and then the frame is stored as it is without a full compression pass
    (about 1 GB/s of a core's time that a small node's upload needs)."""
    if len(raw) <= PROBES * PROBE_SIZE * 2:
        return True
    probe = zstandard.ZstdCompressor(level=1)
    step = (len(raw) - PROBE_SIZE) // (PROBES - 1)
    view = memoryview(raw)
    return any(len(probe.compress(view[i * step:i * step + PROBE_SIZE])) < PROBE_SIZE * 0.95
               for i in range(PROBES))


@dataclass(frozen=True)
class Codec:
    level: int = 3  # zstd level; 0 stores frames uncompressed
    key: bytes | None = None

    @property
    def key_id(self) -> str | None:
        return key_id(self.key) if self.key else None

    def encryption(self) -> dict[str, str] | None:
        """The manifest's record of how files are encrypted."""
        return {"algorithm": ALGORITHM, "key_id": key_id(self.key)} if self.key else None

    def encode(self, raw: bytes, aad: bytes) -> tuple[bytes, bool]:
        """(stored bytes, compressed?) for one frame. Runs in a worker thread:
        zstd and AES-GCM release the GIL."""
        data, compressed = raw, False
        if self.level > 0 and worth_compressing(raw):
            z = zstandard.ZstdCompressor(level=self.level).compress(raw)
            if len(z) < len(raw):
                data, compressed = z, True
        if self.key:
            nonce = os.urandom(NONCE)
            data = nonce + AESGCM(self.key).encrypt(nonce, data, aad)
        return data, compressed

    def decode(self, stored: bytes, raw_size: int, compressed: bool, aad: bytes,
               encryption: dict[str, str] | None) -> bytes:
        data = stored
        if encryption:
            self.check_key(encryption)
            assert self.key is not None
            try:
                data = AESGCM(self.key).decrypt(stored[:NONCE], stored[NONCE:], aad)
            except InvalidTag:
                raise DecodeError(
                    "a frame failed its AES-GCM authentication: the bytes were altered",
                    hint="restore another generation (--generation N)") from None
        if compressed:
            try:
                data = zstandard.ZstdDecompressor().decompress(data, max_output_size=raw_size)
            except zstandard.ZstdError as e:
                raise DecodeError(f"a frame does not decompress: {e}",
                                  hint="restore another generation (--generation N)") from None
        if len(data) != raw_size:
            raise DecodeError(f"a frame holds {len(data)} bytes, the manifest says {raw_size}",
                              hint="restore another generation (--generation N)")
        return data

    def check_key(self, encryption: dict[str, str]) -> None:
        """Refuse early, naming both ids, when this node holds another key."""
        want = encryption.get("key_id", "?")
        if not self.key:
            raise WrongKey(f"the checkpoint is encrypted (key id {want}) and this node has "
                           "no encryption key", hint="set SMR_ENCRYPTION_KEY or "
                           "SMR_ENCRYPTION_KEY_FILE to the key it was written with")
        if key_id(self.key) != want:
            raise WrongKey(f"the checkpoint is encrypted with key id {want}; this node's "
                           f"key is {key_id(self.key)}",
                           hint="configure the key the checkpoint was written with")
