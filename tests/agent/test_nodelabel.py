"""The node agent labels its node runtime.smr.dev/<handler>=true once it has
installed the handler (the label the `smr` RuntimeClass schedules on), and
removes it on an uninstall, before the handler goes: a real agent against the
fake API server, installing into a directory that stands for the node's root."""

from __future__ import annotations

import asyncio
import shutil
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from services.agent import install, nodelabel
from services.agent.__main__ import BUCKETS as AGENT_BUCKETS
from services.agent.service import NodeAgent
from services.checkpointer.admission import agent_windows
from services.kubeapi import api_client
from services.storage.codec import Codec
from services.storage.local import LocalBackend
from services.storage.store import CheckpointStore
from smr import config
from smr.bus import Bus, BusConfig
from tests import nats_auth
from tests.fake_apiserver import FakeApiServer
from tests.fake_apiserver import node as a_node
from tests.helpers.containerd_host import put_containerd
from tests.test_install import IMPORTS_MAIN, NVIDIA_DROP_IN


def a_host(root: Path) -> Path:
    """A node's root file system as the agent sees it: runc, the REAL
    containerd (which the agent asks for its effective config), and a
    containerd config of the node's own (version 2, the runc runtime)."""
    if not put_containerd(root):
        pytest.skip("containerd and root are needed: the agent reads containerd's config dump")
    (root / "usr/bin").mkdir(parents=True, exist_ok=True)
    shutil.copy(shutil.which("runc") or "/bin/true", root / "usr/bin/runc")
    (root / install.CONFIG).parent.mkdir(parents=True)
    (root / install.CONFIG).write_text(
        'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]\n'
        '  runtime_type = "io.containerd.runc.v2"\n')
    return root


async def run_agent(bus: Bus, kube: FakeApiServer, store: CheckpointStore,
                    s: config.Settings) -> None:
    """One agent start: install (or uninstall) and label, serve, stop."""
    api = await api_client(kube.url, token=kube.token("smr-agent"))
    try:
        agent = NodeAgent(bus, api, store, s)
        task = asyncio.create_task(agent.run())
        await asyncio.wait_for(agent.ready.wait(), 30)
        agent.stop()
        await asyncio.wait_for(task, 30)
    finally:
        await api.close()


def events(kube: FakeApiServer, node: str) -> list[dict[str, Any]]:
    return [e for e in kube.list("events", "default")
            if e["involvedObject"] == {"kind": "Node", "apiVersion": "v1", "name": node}]


@pytest.fixture
async def bus(nats_users: nats_auth.SecuredNats, admin_bus: Bus, bus_config: BusConfig
              ) -> AsyncIterator[Bus]:
    """The agent's own NATS user, as deployed (the streams made by admin_bus)."""
    b = await nats_users.connect("smr-agent", bus_config, buckets=AGENT_BUCKETS)
    yield b
    await b.close()


async def test_agent_labels_its_node_once_installed_and_unlabels_on_uninstall(
        bus: Bus, admin_bus: Bus, criu_binary: str, smr_init: Path, tmp_path: Path,
        settings: config.Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    node = f"node-{uuid.uuid4().hex[:6]}"
    host = a_host(tmp_path / "host")
    kube = await FakeApiServer().start()
    store = CheckpointStore(LocalBackend(tmp_path / "store"), Codec(level=1))
    kube.put("nodes", a_node(node, labels={"kubernetes.io/hostname": node}))
    # No systemd runs containerd here: the restart an uninstall needs is recorded.
    restarts: list[str] = []

    async def restart() -> None:
        restarts.append(node)

    monkeypatch.setattr(install, "restart_containerd", restart)
    s = settings.replace(node_name=node, host_root=str(host), runtime_install="files",
                         runtime_binary=str(config.REPO_TOOLS / "smr-runtime"),
                         init=str(smr_init), max_deliver=2, ack_wait=5)
    if not (config.REPO_TOOLS / "smr-runtime").is_file():
        pytest.skip("smr-runtime is not built (make setup)")
    # The node's request consumers, as the watcher makes them (its user may create none).
    await admin_bus.make_node_consumers(node, agent_windows(s))
    try:
        # Before any agent ran: no label, so the smr RuntimeClass places nothing here.
        assert nodelabel.label("smr") not in kube.get("nodes", node)["metadata"]["labels"]

        await run_agent(bus, kube, store, s)
        labels = kube.get("nodes", node)["metadata"]["labels"]
        assert labels[nodelabel.label("smr")] == "true"
        assert nodelabel.label("smr-nvidia") not in labels, "this node has no NVIDIA runtime"
        assert labels["kubernetes.io/hostname"] == node, "the node's own labels stay"
        assert (host / install.BIN / "smr-runtime").is_file()
        assert [e["reason"] for e in events(kube, node)] == ["SmrRuntimeReady"]

        # A node whose handler went away (an operator deleted the block, the
        # agent now runs with SMR_RUNTIME_INSTALL=off): the label goes too.
        text = (host / install.CONFIG).read_text()
        (host / install.CONFIG).write_text(text[:text.index(install.BEGIN)])
        await run_agent(bus, kube, store, s.replace(runtime_install="off"))
        assert nodelabel.label("smr") not in kube.get("nodes", node)["metadata"]["labels"]
        missing = events(kube, node)[-1]
        assert missing["reason"] == "SmrRuntimeMissing" and missing["type"] == "Warning"
        assert "SMR_RUNTIME_INSTALL=off" in missing["message"]

        # Installed again, then uninstalled: the label first, then the files.
        await run_agent(bus, kube, store, s)
        assert kube.get("nodes", node)["metadata"]["labels"][nodelabel.label("smr")] == "true"
        await run_agent(bus, kube, store, s.replace(runtime_install="uninstall"))
        assert nodelabel.label("smr") not in kube.get("nodes", node)["metadata"]["labels"]
        assert install.BEGIN not in (host / install.CONFIG).read_text()
        assert "containerd.runtimes.runc]" in (host / install.CONFIG).read_text()
        assert not (host / install.BIN).exists()
        assert restarts == [node], "containerd restarted once, to drop the handlers"
        # Idempotent: a second uninstall changes nothing and restarts nothing.
        await run_agent(bus, kube, store, s.replace(runtime_install="uninstall"))
        assert restarts == [node]
    finally:
        await store.close()
        await kube.stop()


async def test_a_node_whose_containerd_takes_its_runtimes_from_a_drop_in_is_not_labelled(
        bus: Bus, admin_bus: Bus, criu_binary: str, smr_init: Path, tmp_path: Path,
        settings: config.Settings) -> None:
    """The NVIDIA toolkit's drop-in (imported by the main file) replaces the
    CRI section whole: smr's block in the main file is not in containerd's
    effective config, so the smr RuntimeClass must not send pods here."""
    node = f"node-{uuid.uuid4().hex[:6]}"
    host = a_host(tmp_path / "host")
    (host / install.CONFIG).write_text(IMPORTS_MAIN)
    (host / "etc/containerd/conf.d").mkdir()
    (host / "etc/containerd/conf.d/99-nvidia.toml").write_text(NVIDIA_DROP_IN)
    kube = await FakeApiServer().start()
    store = CheckpointStore(LocalBackend(tmp_path / "store"), Codec(level=1))
    kube.put("nodes", a_node(node, labels={"kubernetes.io/hostname": node}))
    if not (config.REPO_TOOLS / "smr-runtime").is_file():
        pytest.skip("smr-runtime is not built (make setup)")
    s = settings.replace(node_name=node, host_root=str(host), runtime_install="files",
                         runtime_binary=str(config.REPO_TOOLS / "smr-runtime"),
                         init=str(smr_init), max_deliver=2, ack_wait=5)
    await admin_bus.make_node_consumers(node, agent_windows(s))
    try:
        # The install step: containerd would load the edited file without smr's
        # handler, so the file is left as it was; no label.
        await run_agent(bus, kube, store, s)
        assert nodelabel.label("smr") not in kube.get("nodes", node)["metadata"]["labels"]
        assert (host / install.CONFIG).read_text() == IMPORTS_MAIN
        # smr's block in the main file (an older agent's, or written by hand):
        # still no label, and the Event says why.
        (host / install.CONFIG).write_text(install.with_handlers(
            IMPORTS_MAIN, 2, {"smr": Path("/") / install.BIN / "smr-runtime"}))
        await run_agent(bus, kube, store, s.replace(runtime_install="off"))
        assert nodelabel.label("smr") not in kube.get("nodes", node)["metadata"]["labels"], (
            "the node was labelled for a handler its containerd does not have")
        missing = events(kube, node)[-1]
        assert missing["reason"] == "SmrRuntimeMissing" and missing["type"] == "Warning"
        assert "lack smr" in missing["message"] and "imports" in missing["message"], missing
    finally:
        await store.close()
        await kube.stop()
