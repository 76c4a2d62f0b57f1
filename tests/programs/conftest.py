"""Two local nodes sharing one store, for the programs' local-job tests: ``h``
runs the job; ``other_node`` is where a migration restores it."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests import nats_auth
from tests.test_local_smr import Harness, running


@pytest.fixture
async def h(criu_binary: str, nats_users: nats_auth.SecuredNats, tmp_path: Path, node: str
            ) -> AsyncIterator[Harness]:
    async with running(Harness, criu_binary, nats_users, tmp_path, node, 5.0,
                       storage_path=str(tmp_path / "store")) as harness:
        yield harness


@contextlib.asynccontextmanager
async def other_node(criu_binary: str, nats_users: nats_auth.SecuredNats, tmp_path: Path
                     ) -> AsyncIterator[Harness]:
    """A second node on the same NATS and store: the migration's destination,
    logged in as its own node's user."""
    async with running(Harness, criu_binary, nats_users, tmp_path / "b",
                       f"node-b-{uuid.uuid4().hex[:6]}", 5.0,
                       storage_path=str(tmp_path / "store")) as b:
        yield b
