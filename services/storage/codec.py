"""How one frame of a stored file is encoded: zstd, then AES-256-GCM.

Files are cut into frames of at most ``FRAME_SIZE`` raw bytes, each encoded on
its own, so frames can be compressed in parallel, uploaded while CRIU is still
writing, and fetched with parallel ranged GETs. A frame that zstd does not
shrink is stored as it is (random memory costs no extra bytes).

Encrypted frames are ``nonce (12) || ciphertext || tag (16)``; the associated
data binds each frame to its object key and index, so frames cannot be swapped
or replayed between files. The manifest records the key's id (a fingerprint),
never the key.

Each namespace has a data key of its own, derived from the master key (the
Secret) with HKDF and the namespace's name: whoever holds one namespace's key
reads no other's, and a checkpoint whose manifest was made to name another
namespace is refused as "encrypted for another namespace", not reported as
corrupt (one copied as it is names its own namespace: the store refuses it
for its path). Derived rather
than wrapped and stored: no key object in the bucket that a failed write could
lose, and so no checkpoint that one could make unreadable. Rotation: the key
file holds several master keys, one per line, the first writing; the others
still read the generations written with them until those expire.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import os
from dataclasses import dataclass, replace
from pathlib import Path

import zstandard
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from smr.contract.errors import ConfigError, PermanentError

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


@functools.lru_cache(maxsize=256)
def namespace_key(master: bytes, namespace: str) -> bytes:
    """The data key of ``namespace`` under ``master``."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                info=b"smr namespace data key v1:" + namespace.encode()).derive(master)


def load_keys(value: str, file: str) -> tuple[bytes, ...]:
    """The master keys from SMR_ENCRYPTION_KEY (base64) or a file holding one
    per line (a mounted Kubernetes Secret), the writing one first; () when
    neither is set."""
    src = "SMR_ENCRYPTION_KEY"
    if file:
        src = f"SMR_ENCRYPTION_KEY_FILE={file}"
        try:
            value = Path(file).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read the encryption key: {src}: {e}",
                              hint="mount the Secret there, or unset the setting") from None
    keys = []
    for n, line in enumerate(value.split(), 1):
        try:
            key = base64.b64decode(line, validate=True)
        except binascii.Error:
            key = b""
        if len(key) != 32:
            raise ConfigError(f"{src}: key {n} is not a base64-encoded 32-byte key",
                              hint="create one with: head -c 32 /dev/urandom | base64")
        keys.append(key)
    return tuple(keys)


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
    key: bytes | None = None  # the master key new files are written with
    old_keys: tuple[bytes, ...] = ()  # master keys that only read (rotation)
    namespace: str | None = None  # whose data key; None: the master key itself (before 0.6)

    def for_namespace(self, namespace: str) -> Codec:
        return replace(self, namespace=namespace)

    @property
    def data_key(self) -> bytes | None:
        if not self.key or self.namespace is None:
            return self.key
        return namespace_key(self.key, self.namespace)

    @property
    def key_id(self) -> str | None:
        return key_id(self.key) if self.key else None

    def encryption(self) -> dict[str, str] | None:
        """The manifest's record of how files are encrypted."""
        if not self.key:
            return None
        enc = {"algorithm": ALGORITHM, "key_id": key_id(self.data_key or b"")}
        if self.namespace is not None:
            enc.update(master_key_id=key_id(self.key), namespace=self.namespace)
        return enc

    def encode(self, raw: bytes, aad: bytes) -> tuple[bytes, bool]:
        """(stored bytes, compressed?) for one frame. Runs in a worker thread:
        zstd and AES-GCM release the GIL."""
        data, compressed = raw, False
        if self.level > 0 and worth_compressing(raw):
            z = zstandard.ZstdCompressor(level=self.level).compress(raw)
            if len(z) < len(raw):
                data, compressed = z, True
        if key := self.data_key:
            nonce = os.urandom(NONCE)
            data = nonce + AESGCM(key).encrypt(nonce, data, aad)
        return data, compressed

    def decode(self, stored: bytes, raw_size: int, compressed: bool, aad: bytes,
               encryption: dict[str, str] | None) -> bytes:
        data = stored
        if encryption:
            key = self.check_key(encryption)
            try:
                data = AESGCM(key).decrypt(stored[:NONCE], stored[NONCE:], aad)
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

    def check_key(self, encryption: dict[str, str]) -> bytes:
        """The key that reads files encrypted as ``encryption`` says; refused
        early, naming what differs, when this codec holds no such key."""
        want = encryption.get("key_id", "?")
        masters = {key_id(k): k for k in (self.key, *self.old_keys) if k}
        if not masters:
            raise WrongKey(f"the checkpoint is encrypted (key id {want}) and this node has "
                           "no encryption key", hint="set SMR_ENCRYPTION_KEY or "
                           "SMR_ENCRYPTION_KEY_FILE to the key it was written with")
        if "namespace" not in encryption:  # written with the master key itself
            if want not in masters:
                raise WrongKey(f"the checkpoint is encrypted with key id {want}; this node's "
                               f"keys are {', '.join(masters)}",
                               hint="configure the key the checkpoint was written with")
            return masters[want]
        ns, master_id = encryption["namespace"], encryption.get("master_key_id", "?")
        if self.namespace is not None and ns != self.namespace:
            raise WrongNamespace(
                f"the checkpoint is encrypted for another namespace ({ns!r}), and is read "
                f"as one of {self.namespace!r}",
                hint="a checkpoint is restored only in the namespace that wrote it: its "
                     "objects were copied or its manifest altered")
        if master_id not in masters:
            raise WrongKey(f"the checkpoint is encrypted (key id {want}) under master key "
                           f"{master_id}; this node's keys are {', '.join(masters)}",
                           hint="keep a rotated-out key in SMR_ENCRYPTION_KEY_FILE (one per "
                                "line, the writing one first) until its generations expire")
        key = namespace_key(masters[master_id], ns)
        if key_id(key) != want:
            raise WrongKey(f"the checkpoint's data key id {want} is not namespace {ns!r}'s "
                           f"under master key {master_id}",
                           hint="the manifest was altered: restore another generation "
                                "(--generation N)")
        return key


class WrongNamespace(WrongKey):
    code = "wrong-namespace-key"
