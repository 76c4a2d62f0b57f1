"""The S3 backend (aioboto3): any S3-compatible endpoint.

Credentials come from the standard AWS chain (environment, profile, instance
role). Large files go up as multipart uploads (the pipeline bounds how many
parts are in flight); reads are ranged GETs; conditional writes use S3's
If-None-Match / If-Match (HTTP 412 → Conflict). botocore's errors are
translated here and nowhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aioboto3
import aiohttp
from aiobotocore.session import AioSession
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from services.storage.backend import Conflict, NotFound, PendingUpload, StorageError
from smr.retry import retry_s3

MIN_PART = 5 << 20  # S3's smallest part but the last


_LOADER: Any = None


def _session() -> aioboto3.Session:
    """A session of the backend's own (its credentials, which refresh under a
    lock of the event loop that first uses them), with the process's one
    botocore data loader: a client whose service models were read before
    skips reading them again (measured: 268 ms of CPU for a client of a new
    session, 23 ms with the shared loader)."""
    global _LOADER
    core = AioSession()
    if _LOADER is None:
        _LOADER = core.get_component("data_loader")
    else:
        core.register_component("data_loader", _LOADER)
    return aioboto3.Session(botocore_session=core)


class S3Backend:
    def __init__(self, bucket: str, *, prefix: str = "", endpoint_url: str | None = None,
                 path_style: bool = False, region: str | None = None,
                 connections: int = 16) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.endpoint_url = endpoint_url or None
        self.region = region
        addressing = "path" if path_style else "auto"
        self.config = Config(
            s3={"addressing_style": addressing},
            retries={"max_attempts": 5, "mode": "standard"},
            max_pool_connections=connections,
            # Every file carries our own sha256; botocore's extra CRC32 would
            # cost CPU that compression needs on a small node.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        # Parts of image files go with UNSIGNED-PAYLOAD, also over plain
        # http where botocore would hash every byte for the signature (and
        # the server again to check it): their bytes are checked end to end
        # by the sha256 the manifest records, before a restore uses any. The
        # manifest and the pointers stay signed.
        self.bulk_config = self.config.merge(Config(
            s3={"addressing_style": addressing, "payload_signing_enabled": False}))
        self.session = _session()
        self._stack: AsyncExitStack | None = None
        self._clients: dict[bool, Any] = {}
        self._opening = asyncio.Lock()

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{self.prefix}{key}"

    @asynccontextmanager
    async def _client(self, *, bulk: bool = False) -> AsyncIterator[Any]:
        """One client (and connection pool) of each kind for the backend's
        life; ``bulk``: the one whose uploads leave their payload unsigned."""
        async with self._opening:
            if bulk not in self._clients:
                self._stack = self._stack or AsyncExitStack()
                self._clients[bulk] = await self._stack.enter_async_context(
                    self.session.client("s3", endpoint_url=self.endpoint_url,
                                        region_name=self.region,
                                        config=self.bulk_config if bulk else self.config))
        yield self._clients[bulk]

    async def close(self) -> None:
        if self._stack:
            await self._stack.aclose()
        self._stack, self._clients = None, {}

    @asynccontextmanager
    async def _errors(self, key: str) -> AsyncIterator[None]:
        try:
            yield
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("NoSuchKey", "404", "NotFound") or status == 404:
                raise NotFound(f"no object {self.url(key)}") from None
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                raise Conflict(f"{self.url(key)} was written by another writer") from None
            raise StorageError(f"S3 {code or status} on {self.url(key)}: {e}",
                               hint="check the bucket, the endpoint and the credentials"
                               ) from None
        except (TimeoutError, BotoCoreError, aiohttp.ClientError) as e:
            # (aiohttp's errors: a response body cut short, read after botocore's retries.)
            raise StorageError(f"S3 unreachable for {self.url(key)}: {e}",
                               hint="check SMR_S3_ENDPOINT and the network") from None

    def start_upload(self, key: str) -> S3Upload:
        return S3Upload(self, key)

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        if length == 0:
            return b""
        async with self._client() as c, self._errors(key):
            async for attempt in retry_s3():
                with attempt:
                    r = await c.get_object(Bucket=self.bucket, Key=self.prefix + key,
                                           Range=f"bytes={start}-{start + length - 1}")
                    data: bytes = await r["Body"].read()
        return data

    async def put_bytes(self, key: str, data: bytes, *, if_none_match: bool = False,
                        if_match: str | None = None) -> str:
        kw: dict[str, Any] = {}
        if if_none_match:
            kw["IfNoneMatch"] = "*"
        if if_match is not None:
            kw["IfMatch"] = if_match
        async with self._client() as c, self._errors(key):
            r = await c.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data, **kw)
        return str(r["ETag"])

    async def get_bytes(self, key: str) -> tuple[bytes, str]:
        async with self._client() as c, self._errors(key):
            async for attempt in retry_s3():
                with attempt:
                    r = await c.get_object(Bucket=self.bucket, Key=self.prefix + key)
                    data: bytes = await r["Body"].read()
        return data, str(r["ETag"])

    async def list(self, prefix: str) -> list[str]:
        out: list[str] = []
        async with self._client() as c, self._errors(prefix):
            pages = c.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix + prefix)
            async for page in pages:
                out.extend(o["Key"][len(self.prefix):] for o in page.get("Contents", []))
        return sorted(out)

    async def pending_uploads(self, prefix: str) -> list[PendingUpload]:
        out = []
        async with self._client() as c, self._errors(prefix):
            pages = c.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=self.prefix + prefix)
            async for page in pages:
                out.extend(PendingUpload(u["Key"][len(self.prefix):], u["UploadId"],
                                         u["Initiated"].timestamp())
                           for u in page.get("Uploads", []))
        return out

    async def abort_upload(self, upload: PendingUpload) -> None:
        # NotFound is what _errors raises: gone already (another GC) is done.
        with contextlib.suppress(NotFound):
            async with self._client() as c, self._errors(upload.key):
                await c.abort_multipart_upload(Bucket=self.bucket, Key=self.prefix + upload.key,
                                               UploadId=upload.upload_id)

    async def delete(self, keys: list[str]) -> None:
        async with self._client() as c:
            for i in range(0, len(keys), 1000):
                batch = keys[i : i + 1000]
                async with self._errors(batch[0]):
                    await c.delete_objects(Bucket=self.bucket, Delete={
                        "Objects": [{"Key": self.prefix + k} for k in batch], "Quiet": True})


ABORT_WAIT_S = 30.0  # how long abort() waits for a create still in flight


class S3Upload:
    """A multipart upload, begun at the first part. S3 wants every part but
    the last to be at least 5 MiB; the pipeline sends parts that size."""

    def __init__(self, backend: S3Backend, key: str) -> None:
        self.b = backend
        self.key = key
        self.k = backend.prefix + key
        self.upload_id: str | None = None
        self.etags: dict[int, str] = {}
        self._creating: asyncio.Task[str] | None = None

    async def _begin(self) -> str:
        # One create for all parts, run as a task of its own: a part cancelled
        # while the create is in flight (a failed dump) must not lose the
        # upload's id, or abort() could not end an upload S3 did begin.
        if self._creating is None or (self._creating.done() and (
                self._creating.cancelled() or self._creating.exception())):
            self._creating = asyncio.create_task(self._create())
        return await asyncio.shield(self._creating)

    async def _create(self) -> str:
        async with self.b._client() as c, self.b._errors(self.key):
            r = await c.create_multipart_upload(Bucket=self.b.bucket, Key=self.k)
        self.upload_id = r["UploadId"]
        return self.upload_id

    async def put_part(self, number: int, offset: int, data: bytes | bytearray) -> None:
        uid = await self._begin()
        async with self.b._client(bulk=True) as c, self.b._errors(self.key):
            async for attempt in retry_s3():
                with attempt:
                    r = await c.upload_part(Bucket=self.b.bucket, Key=self.k, UploadId=uid,
                                            PartNumber=number, Body=data)
            self.etags[number] = r["ETag"]

    async def complete(self, parts: int) -> None:
        if sorted(self.etags) != list(range(1, parts + 1)):
            missing = sorted(set(range(1, parts + 1)) - set(self.etags))
            raise StorageError(f"{self.b.url(self.key)}: part(s) {missing[:10]} of {parts} "
                               "did not go up; the upload is not completed",
                               hint="the step is retried")
        async with self.b._client() as c, self.b._errors(self.key):
            if self.upload_id is None:
                await c.put_object(Bucket=self.b.bucket, Key=self.k, Body=b"")
                return
            parts = [{"PartNumber": n, "ETag": e} for n, e in sorted(self.etags.items())]
            await c.complete_multipart_upload(Bucket=self.b.bucket, Key=self.k,
                                              UploadId=self.upload_id,
                                              MultipartUpload={"Parts": parts})

    async def abort(self) -> None:
        if self._creating is not None:  # a create in flight: its id is what aborts it
            # Bounded: on a hung S3 a failed step's answer is not held for
            # botocore's whole retry budget (GC aborts what is left).
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._creating), ABORT_WAIT_S)
        if self.upload_id is None:
            return
        with contextlib.suppress(NotFound):
            async with self.b._client() as c, self.b._errors(self.key):
                await c.abort_multipart_upload(Bucket=self.b.bucket, Key=self.k,
                                               UploadId=self.upload_id)
