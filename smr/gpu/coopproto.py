"""The request/acknowledge protocol of the cooperative path, between smr
(smr/gpu/coopgate.py) and the ranks of a training job (smr/coop.py). Standard
library only: the tests' stand-in ranks speak it too.

In the directory smr gives the job (``SMR_COOP_DIR``):

- ``rank-<pid>.json``: written by each rank once its process group exists
  (``pid`` as the rank sees it, in its own PID namespace): smr waits for
  these ranks' acknowledgements;
- ``request.json``: written by smr (``{"id": ...}``), removed when the ranks
  may go on;
- ``ack-<pid>.json``: written by a rank once it holds no communicator,
  naming the request it answers.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

ENV = "SMR_COOP_DIR"
REQUEST = "request.json"
POLL_S = 0.05


def rank_file(d: Path, pid: int) -> Path:
    return d / f"rank-{pid}.json"


def ack_file(d: Path, pid: int) -> Path:
    return d / f"ack-{pid}.json"


def write_json(path: Path, value: dict[str, Any]) -> None:
    """Whole or absent, never half written: the reader is another process."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


class Rank:
    """One rank's side of the protocol, without torch: ``register`` once,
    ``requested`` at each boundary, and when the ranks agreed to pause,
    ``acknowledge`` then ``wait_released``."""

    def __init__(self, directory: Path, rank: int, world: int) -> None:
        self.dir, self.rank, self.world = directory, rank, world
        self.pid = os.getpid()

    def register(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        write_json(rank_file(self.dir, self.pid),
                   {"pid": self.pid, "rank": self.rank, "world": self.world})

    def requested(self) -> bool:
        return (self.dir / REQUEST).exists()

    def acknowledge(self) -> str | None:
        """Say this rank holds no communicator; the request's id, or None
        where the request is gone already."""
        req = read_json(self.dir / REQUEST)
        if req is None:
            return None
        write_json(ack_file(self.dir, self.pid), {"pid": self.pid, "rank": self.rank,
                                                  "id": req.get("id")})
        return str(req.get("id"))

    def wait_released(self, request_id: str | None) -> None:
        """Until smr removes (or replaces) the request this rank answered.
        A restored rank finds none: its checkpoint's request was removed."""
        while request_id is not None:
            req = read_json(self.dir / REQUEST)
            if req is None or str(req.get("id")) != request_id:
                break
            time.sleep(POLL_S)
        ack_file(self.dir, self.pid).unlink(missing_ok=True)
