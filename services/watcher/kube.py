"""The Kubernetes API as the watcher uses it: informers (list, then watch from
the list's resourceVersion) over raw JSON, on a client from services/kubeapi.py.

An informer keeps a cache of the objects and calls its handler with every
change: one object's changes in order, different objects' at the same time
(up to ``concurrency`` changes waiting or running; the watch waits beyond
that). A reclaim wave cordons a whole node pool within a second, and each
node's handling waits on NATS (its drain episode in KV, its pods'
requests): handled one after another, the 50th node's requests waited for
the 49 before it. It survives what API servers do:

- a watch that ends (``timeoutSeconds``) or breaks (a cut connection, a half
  line) is resumed from the last resourceVersion seen, so nothing is missed
  and nothing is replayed;
- bookmarks move that resourceVersion on while nothing changes;
- 410 Gone (the version was compacted away) means a new list; the list is
  compared with the cache and only real differences reach the handler; an
  object deleted and created again under its name meanwhile (a new uid) is
  the old one's DELETED, then the new one's ADDED;
- other failures are retried with capped exponential backoff;
- a handler that fails is called again for that object (its latest state)
  with backoff, not only at the object's next change (a Node changes about
  every 5 minutes in a real cluster); a newer event for it supersedes the
  retry, and is handled only once the retry has ended: one object's
  handlers never run at the same time (nats-py can drop a cancellation, so
  a retry is cancelled until it ends). Handlers must be idempotent (the
  watcher's are: derived request ids);
- a handler that raises CancelledError without the informer being stopped
  (a future cancelled by its owner) has failed like any other;
- when ``run`` ends, so have all its handlers: a stopped watcher publishes
  nothing more.

Objects stay dicts (no model deserialisation): it is the JSON the server sent.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
from kubernetes_asyncio import watch
from kubernetes_asyncio.client.exceptions import ApiException

from smr.aio import cancelling, stop_task

log = logging.getLogger("smr.watcher.kube")

Handler = Callable[[str, dict[str, Any], dict[str, Any] | None], Awaitable[None]]


def key_of(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    ns = meta.get("namespace")
    return f"{ns}/{meta['name']}" if ns else meta["name"]


def rv_of(obj: dict[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion", ""))


def uid_of(obj: dict[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("uid", ""))


class _RawWatch(watch.Watch):
    """A watch that keeps the objects as the JSON dicts the server sent. It
    deserializes nothing, so it needs no API client of its own: the base class
    makes one per watch (an HTTP session, and an SSL context that loads the
    system's CA store, 30 ms of CPU), which only a typed watch uses."""

    def __init__(self) -> None:
        # The base class's state, less its client.
        self._raw_return_type = None
        self._stop = False
        self.resource_version = None
        self.resp = None

    def get_return_type(self, func: object) -> str:
        return ""

    async def close(self) -> None:
        if self.resp is not None:
            self.resp.release()
            self.resp = None


def _still_running() -> None:
    """Raise CancelledError if this task is being cancelled: nats-py and aiohttp
    can turn a cancellation into a TimeoutError, which the informer's loops
    would otherwise take for a broken watch or a failed handler, and go on."""
    if cancelling():
        raise asyncio.CancelledError


class BrokenStream(Exception):
    """The watch connection ended in the middle of an event."""


class Informer:
    def __init__(self, name: str, list_fn: Callable[..., Awaitable[Any]], handler: Handler,
                 *, watch_timeout_s: int = 300, max_backoff_s: float = 10.0,
                 list_timeout_s: float = 60.0, handler_retries: int = 30,
                 concurrency: int = 64, **list_kw: Any) -> None:
        self.name = name
        self.list_fn = list_fn
        self.list_kw = list_kw
        self.handler = handler
        self.watch_timeout_s = watch_timeout_s
        self.max_backoff_s = max_backoff_s
        self.list_timeout_s = list_timeout_s
        self.handler_retries = handler_retries
        self._retries: dict[str, asyncio.Task[None]] = {}  # key → its pending handler retry
        # key → its changes not yet handled (the first is being handled): an
        # object's changes in order, other objects' beside them.
        self._queues: dict[str, deque[tuple[str, dict[str, Any], dict[str, Any] | None]]] = {}
        self._handling: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(concurrency)  # changes queued or being handled
        self.cache: dict[str, dict[str, Any]] = {}
        self.rv: str | None = None
        self.synced = asyncio.Event()
        self.stats = {"lists": 0, "watches": 0, "expired": 0, "broken": 0, "bookmarks": 0,
                      "events": 0, "handler_retries": 0}

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            # Waited for, not only cancelled: a handler that outlived its
            # informer would act for a watcher that has stopped.
            while pending := [t for t in (*self._retries.values(), *self._handling)
                              if not t.done()]:
                await asyncio.gather(*(stop_task(t, again_every=1.0) for t in pending))

    async def _run(self) -> None:
        failures = 0
        while True:
            _still_running()
            try:
                if self.rv is None:
                    await self._list()
                await self._watch()
                failures = 0
            except ApiException as e:
                if e.status == 410:
                    log.info("%s: resourceVersion %s expired; listing again", self.name, self.rv)
                    self.stats["expired"] += 1
                    self.rv = None
                    continue
                failures += 1
                log.warning("%s: API error %s %s; retrying", self.name, e.status, e.reason)
                await self._backoff(failures)
            except (aiohttp.ClientError, TimeoutError, BrokenStream, ConnectionError) as e:
                failures += 1
                self.stats["broken"] += 1
                log.info("%s: watch broke (%s); resuming from %s", self.name,
                         type(e).__name__, self.rv)
                await self._backoff(failures)
            except Exception:
                # Whatever else the server or client does, the informer goes on.
                failures += 1
                log.exception("%s: unexpected error; listing again", self.name)
                self.rv = None
                await self._backoff(failures)

    async def _backoff(self, failures: int) -> None:
        delay = min(self.max_backoff_s, 0.1 * 2 ** min(failures, 10))
        await asyncio.sleep(delay * (0.5 + random.random() / 2))

    async def _list(self) -> None:
        resp = await self.list_fn(_preload_content=False, _request_timeout=self.list_timeout_s,
                                  **self.list_kw)
        try:
            doc = orjson.loads(await resp.read())
        finally:
            resp.release()
        self.stats["lists"] += 1
        fresh = {key_of(o): o for o in doc.get("items") or []}
        # Only differences reach the handler: a re-list after 410 replays nothing.
        for k, old in list(self.cache.items()):
            if k not in fresh:
                del self.cache[k]
                await self._emit("DELETED", old, old)
        for k, obj in fresh.items():
            old = self.cache.get(k)
            if old is not None and rv_of(old) == rv_of(obj):
                continue
            self.cache[k] = obj
            if old is not None and uid_of(old) != uid_of(obj):
                # Deleted and created again while unwatched: two objects, not
                # one that changed (the old one's heartbeats, its drain
                # bookkeeping, its recreation hang on its deletion).
                await self._emit("DELETED", old, old)
                old = None
            await self._emit("MODIFIED" if old else "ADDED", obj, old)
        self.rv = doc["metadata"]["resourceVersion"]
        self.synced.set()

    async def _watch(self) -> None:
        self.stats["watches"] += 1
        async with _RawWatch() as w:
            stream = w.stream(self.list_fn, resource_version=self.rv,
                              allow_watch_bookmarks=True, timeout_seconds=self.watch_timeout_s,
                              _request_timeout=(10, self.watch_timeout_s + 30), **self.list_kw)
            while True:
                _still_running()
                # A watchdog over the client's own timeouts: a connection that
                # went quiet without closing must not hold the informer forever.
                try:
                    ev = await asyncio.wait_for(anext(stream), self.watch_timeout_s + 30)
                except StopAsyncIteration:
                    return
                if not isinstance(ev, dict):  # a half line: the connection broke mid-event
                    raise BrokenStream(str(ev)[:80])
                kind, obj = ev["type"], ev["raw_object"]
                if kind == "BOOKMARK":
                    self.stats["bookmarks"] += 1
                    self.rv = rv_of(obj)
                    continue
                k = key_of(obj)
                old = self.cache.get(k)
                if kind == "DELETED":
                    self.cache.pop(k, None)
                else:
                    self.cache[k] = obj
                self.rv = rv_of(obj)
                await self._emit(kind, obj, old)

    async def _emit(self, kind: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        """Hand the change to its object's queue; wait only when ``concurrency``
        changes are already queued or being handled."""
        self.stats["events"] += 1
        await self._slots.acquire()
        k = key_of(obj)
        if (queue := self._queues.get(k)) is not None:
            queue.append((kind, obj, old))  # after the change of k being handled now
            return
        self._queues[k] = deque([(kind, obj, old)])
        task = asyncio.create_task(self._handle_all(k))
        self._handling.add(task)
        task.add_done_callback(self._handling.discard)

    async def _handle_all(self, k: str) -> None:
        queue = self._queues[k]
        try:
            while queue:
                kind, obj, old = queue[0]
                try:
                    await self._handle(k, kind, obj, old)
                finally:
                    queue.popleft()
                    self._slots.release()
        finally:
            # Only a stop ends this with changes left: their slots go back.
            for _ in queue:
                self._slots.release()
            queue.clear()
            if self._queues.get(k) is queue:
                del self._queues[k]

    async def _handle(self, k: str, kind: str, obj: dict[str, Any],
                      old: dict[str, Any] | None) -> None:
        if (pending := self._retries.get(k)) is not None:
            # This newer change supersedes it, once it has ended: else the
            # two run beside each other (an uncordon handled before its
            # cordon's retried requests are out). It stays in _retries until
            # then, for run() to stop should this task be stopped meanwhile.
            await stop_task(pending, again_every=1.0)
            if self._retries.get(k) is pending:
                del self._retries[k]
        try:
            await self.handler(kind, obj, old)
        except (Exception, asyncio.CancelledError):
            _still_running()  # the informer's stop: not a failure
            # One bad object must not stop the informer; it is retried.
            log.exception("%s: handling %s %s failed; retrying with backoff", self.name,
                          kind, k)
            self._retries[k] = asyncio.create_task(self._retry(k, kind, obj, old))

    async def _retry(self, k: str, kind: str, obj: dict[str, Any],
                     old: dict[str, Any] | None) -> None:
        for attempt in range(1, self.handler_retries + 1):
            await self._backoff(attempt)
            if kind != "DELETED":
                obj = self.cache.get(k, obj)
            self.stats["handler_retries"] += 1
            try:
                await self.handler(kind, obj, old)
            except (Exception, asyncio.CancelledError) as e:
                _still_running()
                log.warning("%s: handling %s %s failed again (attempt %d of %d): %r",
                            self.name, kind, k, attempt, self.handler_retries, e)
            else:
                break
        if self._retries.get(k) is asyncio.current_task():
            del self._retries[k]
