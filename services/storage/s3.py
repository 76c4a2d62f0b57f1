"""The S3 backend (aioboto3): any S3-compatible endpoint.

Credentials come from the standard AWS chain (environment, profile, instance
role). Large files go up as multipart uploads with a bounded number of parts in
flight; conditional writes use S3's If-None-Match / If-Match (HTTP 412 →
Conflict). botocore's errors are translated here and nowhere else.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aioboto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from services.storage.backend import Conflict, NotFound, StorageError
from smr.retry import retry_s3

PART_SIZE = 16 << 20
PARTS_IN_FLIGHT = 4  # memory bound of one upload: PART_SIZE * PARTS_IN_FLIGHT


class S3Backend:
    def __init__(self, bucket: str, *, prefix: str = "", endpoint_url: str | None = None,
                 path_style: bool = False, region: str | None = None) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.endpoint_url = endpoint_url or None
        self.region = region
        self.config = Config(
            s3={"addressing_style": "path" if path_style else "auto"},
            retries={"max_attempts": 5, "mode": "standard"},
            max_pool_connections=PARTS_IN_FLIGHT * 2,
        )
        self.session = aioboto3.Session()

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{self.prefix}{key}"

    @asynccontextmanager
    async def _client(self) -> AsyncIterator[Any]:
        async with self.session.client("s3", endpoint_url=self.endpoint_url,
                                       region_name=self.region, config=self.config) as c:
            yield c

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
        except BotoCoreError as e:
            raise StorageError(f"S3 unreachable for {self.url(key)}: {e}",
                               hint="check SMR_S3_ENDPOINT and the network") from None

    async def put_file(self, key: str, src: Path) -> tuple[int, str]:
        size = src.stat().st_size
        k = self.prefix + key
        async with self._client() as c, self._errors(key):
            if size <= PART_SIZE:
                data = src.read_bytes()
                async for attempt in retry_s3():
                    with attempt:
                        await c.put_object(Bucket=self.bucket, Key=k, Body=data)
                return size, hashlib.sha256(data).hexdigest()
            return await self._multipart(c, k, src)

    async def _multipart(self, c: Any, k: str, src: Path) -> tuple[int, str]:
        up = await c.create_multipart_upload(Bucket=self.bucket, Key=k)
        uid = up["UploadId"]
        h, size, parts = hashlib.sha256(), 0, []
        slots = asyncio.Semaphore(PARTS_IN_FLIGHT)

        async def send(n: int, data: bytes) -> dict[str, Any]:
            try:
                async for attempt in retry_s3():
                    with attempt:
                        r = await c.upload_part(Bucket=self.bucket, Key=k, UploadId=uid,
                                                PartNumber=n, Body=data)
                return {"PartNumber": n, "ETag": r["ETag"]}
            finally:
                slots.release()

        try:
            with open(src, "rb") as f:
                n = 0
                while True:
                    await slots.acquire()  # bounded memory: wait for a free slot
                    data = await asyncio.to_thread(f.read, PART_SIZE)
                    if not data:
                        slots.release()
                        break
                    n += 1
                    h.update(data)
                    size += len(data)
                    parts.append(asyncio.create_task(send(n, data)))
            done = await asyncio.gather(*parts)
            await c.complete_multipart_upload(Bucket=self.bucket, Key=k, UploadId=uid,
                                              MultipartUpload={"Parts": list(done)})
        except BaseException:
            for t in parts:
                t.cancel()
            await c.abort_multipart_upload(Bucket=self.bucket, Key=k, UploadId=uid)
            raise
        return size, h.hexdigest()

    async def get_file(self, key: str, dst: Path) -> tuple[int, str]:
        dst.parent.mkdir(parents=True, exist_ok=True)
        h, size = hashlib.sha256(), 0
        async with self._client() as c, self._errors(key):
            r = await c.get_object(Bucket=self.bucket, Key=self.prefix + key)
            with open(dst, "wb") as out:
                async for chunk in r["Body"].iter_chunks(1 << 20):
                    h.update(chunk)
                    size += len(chunk)
                    out.write(chunk)
        return size, h.hexdigest()

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
            r = await c.get_object(Bucket=self.bucket, Key=self.prefix + key)
            data = await r["Body"].read()
        return data, str(r["ETag"])

    async def list(self, prefix: str) -> list[str]:
        out: list[str] = []
        async with self._client() as c, self._errors(prefix):
            pages = c.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix + prefix)
            async for page in pages:
                out.extend(o["Key"][len(self.prefix):] for o in page.get("Contents", []))
        return sorted(out)

    async def delete(self, keys: list[str]) -> None:
        async with self._client() as c:
            for i in range(0, len(keys), 1000):
                batch = keys[i : i + 1000]
                async with self._errors(batch[0]):
                    await c.delete_objects(Bucket=self.bucket, Delete={
                        "Objects": [{"Key": self.prefix + k} for k in batch], "Quiet": True})
