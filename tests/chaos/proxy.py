"""A fault-injecting HTTP proxy between smr's S3 client and a real S3 server.

While a fault is on, each request is hit with probability ``rate``:

- ``5xx``: answered 503 SlowDown or 500 InternalError (S3's own XML), as an
  overloaded S3 does; botocore retries these.
- ``cut``: the connection is dropped, either before any answer or halfway
  through the response body (a part or a ranged GET cut mid-transfer).
- ``slow``: answered only after 0.2-1.5 s.
- ``hang``: no answer for ``hang_s``, then the connection is dropped.

Faults below the client's retries (each request of its kind is hit while on):

- ``part-fail``: every part of a multipart upload answered 500, as long as
  the fault lasts: botocore's retries run out and the upload fails.
- ``lost-answer``: a conditional PUT (If-None-Match / If-Match: a claim, a
  manifest, ``latest``) is carried out upstream, then its answer is dropped:
  the write happened, the client saw an error (and its retry meets 412).
- ``down``: every connection dropped at once: storage unreachable.

``after_manifest``: called with the key of each manifest the server has
stored, before the client hears of it (the campaign kills the writer there).

Everything else is forwarded unchanged (method, path, query, headers, body).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from collections.abc import Callable

import aiohttp
from aiohttp import web

# A client that gave up leaves aiohttp a closed transport to answer on: noise here.
logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)

FAULTS = ("5xx", "cut", "slow", "hang", "part-fail", "lost-answer", "down")
_XML = ('<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
        '<Message>{message}</Message></Error>')
_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


class FaultProxy:
    def __init__(self, upstream: str, *, seed: int, hang_s: float = 8.0) -> None:
        self.upstream = upstream.rstrip("/")
        self.rng = random.Random(seed)
        self.hang_s = hang_s
        self.fault: str | None = None
        self.rate = 0.0
        self.injected: Counter[str] = Counter()
        self.forwarded = 0
        self.port = 0
        self.after_manifest: Callable[[str], None] | None = None

    def set(self, fault: str | None, rate: float = 0.3) -> None:
        self.fault, self.rate = fault, rate

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> FaultProxy:
        self.session = aiohttp.ClientSession(
            auto_decompress=False, timeout=aiohttp.ClientTimeout(total=120))
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        await self.runner.cleanup()
        await self.session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._answer(request)
        except (ConnectionError, aiohttp.ClientError):
            # The client gave up (its timeout, or a retry): nothing to answer.
            return web.Response(status=499)

    def _hits(self, request: web.Request) -> str | None:
        if not self.fault:
            return None
        if self.fault == "part-fail":
            hit = request.method == "PUT" and "partNumber" in request.query
        elif self.fault == "lost-answer":
            hit = request.method == "PUT" and ("If-None-Match" in request.headers
                                               or "If-Match" in request.headers)
        elif self.fault == "down":
            hit = True
        else:
            hit = self.rng.random() < self.rate
        return self.fault if hit else None

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        fault = self._hits(request)
        cut_midway = lost_answer = False
        if fault:
            self.injected[fault] += 1
        if fault == "part-fail":
            return web.Response(status=500, content_type="application/xml",
                                text=_XML.format(code="InternalError",
                                                 message="injected: a part that keeps failing"))
        if fault == "down":
            _drop(request)
            return web.Response(status=500)
        lost_answer = fault == "lost-answer"
        if fault == "5xx":
            code, status = self.rng.choice([("SlowDown", 503), ("InternalError", 500)])
            return web.Response(status=status, content_type="application/xml",
                                text=_XML.format(code=code, message="injected by the proxy"))
        if fault == "hang":
            await asyncio.sleep(self.hang_s)
            _drop(request)
            return web.Response(status=500)
        if fault == "slow":
            await asyncio.sleep(self.rng.uniform(0.2, 1.5))
        if fault == "cut":
            if self.rng.random() < 0.5:
                _drop(request)
                return web.Response(status=500)
            cut_midway = True
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with self.session.request(request.method, self.upstream + request.path_qs,
                                        headers=headers, data=body) as up:
            data = await up.read()
            self.forwarded += 1
            if lost_answer:  # carried out; the client never hears of it
                _drop(request)
                return web.Response(status=500)
            if (self.after_manifest and request.method == "PUT" and up.status == 200
                    and request.path.endswith("/manifest.json")):
                self.after_manifest(request.path)
            out = web.StreamResponse(status=up.status, headers={
                k: v for k, v in up.headers.items() if k.lower() not in _HOP})
            out.content_length = len(data)
            await out.prepare(request)
            if cut_midway and len(data) > 1:
                await out.write(data[: len(data) // 2])
                _drop(request)
                return out
            await out.write(data)
            await out.write_eof()
            return out


def _drop(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.abort()
