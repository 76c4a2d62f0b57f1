"""The step locks of a test's node (smr/bus/liveness.py): one directory per
node name, so every worker a test starts for one node shares it, as the
workers of a real node do."""

from __future__ import annotations

import tempfile
from pathlib import Path

from smr.bus import StepLocks, node_token


def node_locks(node: str) -> StepLocks:
    return StepLocks(Path(tempfile.gettempdir()) / "smr-test-step-locks" / node_token(node))
