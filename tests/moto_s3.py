"""The tests' S3: moto's server (a separate process, real HTTP), with one
change where the product depends on S3's behaviour and moto's differs.

S3 carries out a conditional write (If-Match, If-None-Match) atomically: of
two writes racing on one ETag, one wins and the other gets 412. moto checks
the condition and then writes, two steps on its server's threads, so under
load both racers can pass the check (seen in a -n 4 run of
tests/test_storage.py::test_conditional_write_race_has_one_winner). Here every
write that replaces or removes one object (a PUT without a part number, a
multipart upload's completion, a DELETE of one key) runs alone for its key;
parts, reads and batch deletes (POST ?delete, by bucket) run as moto runs
them.

moto finds each request's service anew, matching a host made from it
against every service's URL patterns; here a signed request's service is
remembered by its credential scope, what moto makes that host from. With
werkzeug's request log off too, a checkpoint's small requests take 4.8 ms of
the server's CPU each instead of 6.9 (bench/moto_requests.py, both in one
run).

    python tests/moto_s3.py -H 127.0.0.1 -p PORT
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs


def command(port: int) -> list[str]:
    """The command line of a server on 127.0.0.1:``port``."""
    return [sys.executable, str(Path(__file__).resolve()), "-H", "127.0.0.1", "-p", str(port)]


class OneWriterAKey:
    """WSGI middleware: writes that replace or remove an object, one at a
    time for each key, their whole answer made inside the turn."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app
        self.guard = threading.Lock()
        self.keys: dict[str, threading.Lock] = {}

    def _lock(self, path: str) -> threading.Lock:
        with self.guard:
            return self.keys.setdefault(path, threading.Lock())

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "")
        query = parse_qs(environ.get("QUERY_STRING", ""))
        replaces = (method == "PUT" and "partNumber" not in query) or method == "DELETE" \
            or (method == "POST" and "uploadId" in query)
        if not replaces:
            return self.app(environ, start_response)
        with self._lock(environ.get("PATH_INFO", "")):
            return list(self.app(environ, start_response))


def remember_services(app: Any) -> Any:
    """``app`` (moto's DomainDispatcherApplication), its ``get_application``
    answering a SigV4-signed request outside moto's own paths from what it
    answered before for the same credential scope (region and service: moto
    infers the service from them alone, as the host it then matches)."""
    infer = app.get_application
    known: dict[str, Any] = {}

    def get_application(environ: dict[str, Any]) -> Any:
        path = environ.get("PATH_INFO", "")
        auth = environ.get("HTTP_AUTHORIZATION", "")
        if not auth.startswith("AWS4-") or not isinstance(path, str) \
                or path.startswith(("/moto-api", "/latest/", "/@connections", "/favicon.ico")):
            return infer(environ)
        # Credential=KEY/DATE/REGION/SERVICE/aws4_request
        scope = "/".join(auth.split(",", 1)[0].partition("Credential=")[2].split("/")[2:4])
        if (found := known.get(scope)) is None:
            found = known[scope] = infer(environ)
        return found

    app.get_application = get_application
    return app


def main() -> None:
    # Run as a script, this file's directory comes first on the path: the
    # tests' modules must not stand in for any moto imports.
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]
    from moto import server

    # A line for each request, formatted and written to where the tests send
    # it (/dev/null): werkzeug's request log, off.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)

    # moto.server.main builds DomainDispatcherApplication and serves it with
    # run_simple; the same, through the middleware.
    real = server.DomainDispatcherApplication

    def wrapped(*a: Any, **kw: Any) -> Any:
        return OneWriterAKey(remember_services(real(*a, **kw)))

    server.DomainDispatcherApplication = wrapped  # type: ignore[assignment,misc]
    server.main(sys.argv[1:])


if __name__ == "__main__":
    main()
