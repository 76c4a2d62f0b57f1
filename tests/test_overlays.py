"""The overlays as an operator applies them, following docs/kubernetes.md's
"Install, in order": every namespaced object lands in a namespace the steps
made first, each overlay names its prerequisites, and one `images:` entry in
the operator's own overlay sets every smr container."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from smr import config
from smrctl.cli import COMMANDS
from tests.deploy_render import ROOT, render
from tests.fake_apiserver import FakeApiServer

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


def install_steps(overlay: str) -> list[list[str]]:
    """The kubectl commands of ``overlay``'s row of the install section, in the
    order given there; a step that points at the commands at the top of the
    overlay's kustomization.yaml gets those (the Secrets)."""
    row = next(line for line in install_section().splitlines()
               if line.startswith(f"| `{overlay}` |"))
    steps = row.rsplit("|", 2)[1]
    out: list[list[str]] = []
    for step in re.split(r"\s\d\.\s", f" {steps}"):
        out += [c.split() for c in re.findall(r"`(kubectl [^`]+)`", step)]
        if "at the top of" in step and "kustomization.yaml" in step:
            head = (ROOT / "overlays" / overlay / "kustomization.yaml").read_text()
            joined = re.sub(r"\\\n#\s*", " ", head)
            out += [line.lstrip("# ").split()[:7] for line in joined.splitlines()
                    if re.match(r"#\s+kubectl -n \S+ create secret generic", line)]
    return out


class Kubectl:
    """The commands of the install section, against the FAKE API server as an
    operator's kubectl sends them: ``create namespace``, ``create secret``,
    ``apply -k`` (each object in kustomize's order: created, or replaced where
    it exists; a namespaced one in its namespace, or the kubeconfig's
    current one, ``default``)."""

    def __init__(self, api: FakeApiServer, kustomize: str) -> None:
        self.api, self.kustomize = api, kustomize
        self.plural = {kind: plural for plural, (kind, _, _) in api.resources.items()}
        self.placed: list[str] = []  # KIND/NAME@NAMESPACE, as applied

    async def run(self, http: aiohttp.ClientSession, argv: list[str]) -> None:
        words = [w for w in argv[1:] if not w.startswith("--")]
        ns = "default"
        if "-n" in words:
            i = words.index("-n")
            ns, words = words[i + 1], words[:i] + words[i + 2:]
        if words[:2] == ["create", "namespace"]:
            await self.send(http, {"apiVersion": "v1", "kind": "Namespace",
                                   "metadata": {"name": words[2]}})
        elif words[:3] == ["create", "secret", "generic"]:
            await self.send(http, {"apiVersion": "v1", "kind": "Secret",
                                   "metadata": {"name": words[3], "namespace": ns}})
        elif words[:2] == ["apply", "-k"]:
            built = await asyncio.create_subprocess_exec(
                self.kustomize, "build", str(REPO / words[2]), stdout=subprocess.PIPE)
            out, _ = await built.communicate()
            assert built.returncode == 0, f"kustomize build {words[2]} failed"
            for doc in yaml.safe_load_all(out):
                if doc:
                    await self.send(http, doc, apply=True)
        else:
            pytest.fail(f"the install section's `{' '.join(argv)}` is not a step this "
                        "test knows")

    async def send(self, http: aiohttp.ClientSession, obj: dict[str, Any], *,
                   apply: bool = False) -> None:
        kind = obj["kind"]
        assert kind in self.plural, f"{kind}: the API server serves no such kind (its CRD?)"
        plural = self.plural[kind]
        _, namespaced, prefix = self.api.resources[plural]
        ns = obj["metadata"].get("namespace") or "default"
        base = f"{self.api.url}{prefix}" + (f"/namespaces/{ns}" if namespaced else "")
        auth = {"Authorization": f"Bearer {self.api.admin_token}"}
        async with http.post(f"{base}/{plural}", json=obj, headers=auth) as r:
            body = await r.text()
            if apply and r.status == 409:
                async with http.put(f"{base}/{plural}/{obj['metadata']['name']}", json=obj,
                                    headers=auth) as again:
                    body, code = await again.text(), again.status
            else:
                code = r.status
        assert code in (200, 201), f"{kind}/{obj['metadata']['name']}: {code} {body}"
        self.placed.append(f"{kind}/{obj['metadata']['name']}"
                           + (f"@{ns}" if namespaced else ""))


# monitoring: "not an install" (its row): a component for an overlay of your own.
@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if o != "monitoring"])
async def test_each_overlay_applies_in_the_documented_order(kustomize: str,
                                                            overlay: str) -> None:
    """Every command of the overlay's install steps, in order, against an API
    server that refuses an object in a namespace not made yet (as a real one
    does): every object accepted, each in the namespace it names."""
    api = await FakeApiServer(namespaces=True).start()
    try:
        kubectl = Kubectl(api, kustomize)
        steps = install_steps(overlay)
        assert any(s[1:3] == ["apply", "-k"] for s in steps), steps
        async with aiohttp.ClientSession() as http:
            for argv in steps:
                await kubectl.run(http, argv)
        stray = [p for p in kubectl.placed if p.endswith("@default")]
        assert not stray, f"{overlay}: objects in the kubeconfig's namespace: {stray}"
        assert api.get("namespaces", "smr-system") is not None
    finally:
        await api.stop()
