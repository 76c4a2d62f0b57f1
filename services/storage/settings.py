"""The checkpoint store and the storage service as the settings describe
them (local directory or S3, compression, encryption, retention): one place
for the embedded mode, the agent and the storage Deployment."""

from __future__ import annotations

from services.storage.codec import Codec, load_keys
from services.storage.local import LocalBackend
from services.storage.mirror import Mirror
from services.storage.service import StorageService
from services.storage.store import CheckpointStore
from smr.bus import Bus
from smr.config import Settings


def make_store(settings: Settings) -> CheckpointStore:
    keys = load_keys(settings.encryption_key, settings.encryption_key_file)
    codec = Codec(level=settings.zstd_level, key=keys[0] if keys else None, old_keys=keys[1:])
    # A writer renews its claim four times per grace: GC never reaps a live one.
    beat = max(settings.gc_grace / 4, 1.0)
    if settings.storage == "s3":
        from services.storage.s3 import S3Backend  # aioboto3: only where S3 is used

        return CheckpointStore(S3Backend(
            settings.s3_bucket, prefix=settings.s3_prefix,
            endpoint_url=settings.s3_endpoint or None, path_style=settings.s3_path_style,
            region=settings.s3_region or None), codec, heartbeat_s=beat)
    return CheckpointStore(LocalBackend(settings.storage_root), codec, heartbeat_s=beat)


def make_storage_service(bus: Bus, store: CheckpointStore, s: Settings,
                         mirror: Mirror | None = None) -> StorageService:
    return StorageService(bus, store, keep=s.keep_generations, max_age_s=s.max_age,
                          gc_grace_s=s.gc_grace, gc_interval_s=s.gc_interval, mirror=mirror)
