"""The step locks of a test's node (smr/bus/liveness.py): one directory per
node name, so every worker a test starts for one node shares it, as the
workers of a real node do (a helper process such as slow_worker.py too: it
inherits SMR_TEST_STEP_LOCKS). Under the test session's own temporary
directory (tests/conftest.py), never one that another session's tests share."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from smr.bus import StepLocks, node_token

ENV = "SMR_TEST_STEP_LOCKS"


def node_locks(node: str) -> StepLocks:
    root = os.environ.get(ENV) or os.environ.setdefault(
        ENV, tempfile.mkdtemp(prefix="smr-step-locks-"))
    return StepLocks(Path(root) / node_token(node))
