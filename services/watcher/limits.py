"""The watcher's bounds, in one place: how long it waits on the API, on a
result, on its own tasks, and how much it remembers."""

from __future__ import annotations

MEMO_SIZE = 200_000
RESULT_WAIT_S = 900.0  # how long a recreation waits for the pod's last checkpoint
REQUEST_TTL_S = 900.0  # a node signal's requests: refused by the agent after this
READY_SETTLE_S = 2.0  # a Ready pod waits this past its Ready second before taking a template
API_TIMEOUT_S = 30.0  # one Kubernetes API call (a hung connection must not hold a handler)
STOP_WAIT_S = 10.0  # how long a stopping watcher waits for its tasks
