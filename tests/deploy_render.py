"""deploy/kustomize as `kubectl apply -k` renders it (``kustomize build``): the
one source of the manifests and NATS users the tests read. Kept apart from
tests/test_deploy.py, which validates them against the Kubernetes schemas,
so the cluster tests need only kustomize and PyYAML (the GPU machine has no
more)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent / "deploy" / "kustomize"


def render(kustomize: str, overlay: str) -> list[dict[str, Any]]:
    out = subprocess.run([kustomize, "build", str(ROOT / "overlays" / overlay)],
                         capture_output=True, text=True)
    assert out.returncode == 0, f"kustomize build {overlay}: {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]
