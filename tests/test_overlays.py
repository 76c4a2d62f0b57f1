"""The overlays as an operator applies them, following docs/kubernetes.md's
"Install, in order": every namespaced object lands in a namespace the steps
made first, each overlay names its prerequisites, and one `images:` entry in
the operator's own overlay sets every smr container."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from smr import config
from smrctl.cli import COMMANDS
from tests.deploy_render import ROOT, render

REPO = ROOT.parent.parent
OVERLAYS = sorted(p.name for p in (ROOT / "overlays").iterdir() if p.is_dir())
# Kinds a namespace means nothing to (kubectl api-resources --namespaced=false).
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "RuntimeClass",
                  "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration",
                  "CustomResourceDefinition", "PriorityClass", "StorageClass", "Node",
                  "PersistentVolume", "APIService"}


@pytest.fixture(scope="module")
def kustomize() -> str:
    return str(config.REPO_TOOLS / "kustomize")


def install_section() -> str:
    text = (REPO / "docs" / "kubernetes.md").read_text()
    return text.split("## Install, in order", 1)[1].split("\n## ", 1)[0]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_namespaced_object_of_an_overlay_has_its_namespace(
        kustomize: str, overlay: str) -> None:
    """`kubectl apply -k` puts an object without one in the kubeconfig's
    current namespace, wherever that is."""
    homeless = [f"{d['kind']}/{d['metadata']['name']}" for d in render(kustomize, overlay)
                if d["kind"] not in CLUSTER_SCOPED and not d["metadata"].get("namespace")]
    assert not homeless, f"{overlay}: no namespace on {homeless}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_overlay_names_its_prerequisites_and_the_install_steps_name_it(
        overlay: str) -> None:
    head = []
    for line in (ROOT / "overlays" / overlay / "kustomization.yaml").read_text().splitlines():
        if not line.startswith("#"):
            break
        head.append(line)
    assert any("Prerequisites:" in line for line in head), \
        f"overlays/{overlay}/kustomization.yaml names no prerequisites at its top"
    assert f"| `{overlay}` |" in install_section(), \
        f"docs/kubernetes.md's install section has no row for {overlay}"


@pytest.mark.parametrize("overlay", ["gpu", "prod"])
def test_one_images_entry_sets_every_smr_container(
        kustomize: str, overlay: str, tmp_path: Path) -> None:
    """What docs/kubernetes.md tells an operator to do with their own build,
    on an overlay of theirs with every component that runs smr's image."""
    mine = tmp_path / "mine"
    mine.mkdir()
    base = ROOT / "overlays" / overlay
    (mine / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        # kustomize takes relative paths only
        "resources": [os.path.relpath(base, mine)],
        "components": [os.path.relpath(ROOT / "components" / "nats-callout", mine)],
    }))
    image = "registry.internal/team/smr:9.9.9"
    step = install_section()
    edit = re.search(r"kustomize edit set image (ghcr\.io/smr-dev/smr)=", step)
    assert edit, "the install section says how to set the image"
    subprocess.run([kustomize, "edit", "set", "image", f"{edit.group(1)}={image}"],
                   cwd=mine, check=True)
    out = subprocess.run([kustomize, "build", "--load-restrictor", "LoadRestrictionsNone",
                          str(mine)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    images = set()
    for d in yaml.safe_load_all(out.stdout):
        spec = ((d or {}).get("spec") or {}).get("template", {}).get("spec", {})
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            images.add(c["image"])
    smr = {i for i in images if "smr" in i}
    assert smr == {image}, f"{overlay}: smr containers still run {smr - {image}}"


def test_every_command_of_smr_is_documented() -> None:
    docs = (REPO / "README.md").read_text() + "".join(
        p.read_text() for p in (REPO / "docs").glob("*.md"))
    missing = [c for c in COMMANDS if f"smr {c}" not in docs]
    assert not missing, f"commands no page names: {missing}"
    assert "`-v`" in (REPO / "README.md").read_text() or "smr -v" in docs
