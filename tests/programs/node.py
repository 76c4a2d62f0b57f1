"""Node.js (Debian's `nodejs`), for the program tests: an HTTP server with its
state in a Map and a setInterval timer, and a client for it.

The server answers GET /inc/KEY (count KEY) and GET / with its state: the
counts, the timer's ticks, and its process id.
"""

from __future__ import annotations

import http.client
import json
import shutil
import socket
from collections.abc import Callable
from typing import Any

import pytest

INTERVAL_S = 0.1
SERVER = b"""
const http = require('http');
const counts = new Map();
let ticks = 0;
setInterval(() => { ticks++; }, 100);
http.createServer((req, res) => {
  if (req.url.startsWith('/inc/')) {
    const k = req.url.slice(5);
    counts.set(k, (counts.get(k) || 0) + 1);
  }
  res.setHeader('Content-Type', 'application/json');
  res.end(JSON.stringify({counts: Object.fromEntries(counts), ticks, pid: process.pid}));
}).listen(Number(process.argv[2]), process.argv[3] || '127.0.0.1');
"""


def node_binary() -> str:
    found = shutil.which("node") or shutil.which("nodejs")
    if found is None:
        pytest.fail("Node.js is missing: `make setup` installs Debian's nodejs")
    return found


def get(port: int, path: str = "/",
        connect: Callable[[], socket.socket] | None = None) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    if connect:
        conn.sock = connect()
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        assert resp.status == 200
        return json.loads(resp.read())  # type: ignore[no-any-return]
    finally:
        conn.close()


def assert_timer_kept_its_rhythm(before: int, after: int, elapsed_s: float) -> None:
    """It went on (not restarted from 0) and fired no burst of missed ticks:
    at most one tick per interval of the time that passed, downtime included."""
    assert after > before, f"the timer stopped or restarted: {before} -> {after}"
    assert after - before <= elapsed_s / INTERVAL_S + 2, (
        f"{after - before} ticks in {elapsed_s:.2f}s: a burst of missed ticks")
