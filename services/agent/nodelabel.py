"""The node labels that tell the scheduler where smr's runtime handlers are.

The RuntimeClasses ``smr`` and ``smr-nvidia`` (deploy/kustomize) carry
``scheduling.nodeSelector`` on ``runtime.smr.dev/<handler>: "true"``, so a pod
given one is placed only on a node whose containerd has that handler. Without
it, an opted-in pod landing on a node where no agent installed smr-runtime
could not start its container; with it, the pod waits in Pending (the
scheduler's FailedScheduling Event says the node selector did not match).

After its install step, the agent labels its node with each handler the
node's containerd config declares in smr's block (services/agent/install.py),
whose smr-runtime is there and which the node's containerd really has (its
``config dump``: a CRI section from an ``imports`` drop-in replaces the main
file's, smr's block with it), and removes the label of any handler that is
not; an Event on the Node says which, and why. ``SMR_RUNTIME_INSTALL=uninstall`` removes the
labels first (no new pod is placed here), then the handlers and binaries.
"""

from __future__ import annotations

import logging
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from services.agent import install
from smr.config import Settings

log = logging.getLogger("smr.agent")

PREFIX = "runtime.smr.dev/"
HANDLERS = ("smr", "smr-nvidia")  # what install.py can install
COMPONENT = "smr-agent"


def label(handler: str) -> str:
    return PREFIX + handler


def installed_handlers(host: Path) -> tuple[list[str], str]:
    """The handlers of smr's block in the node's containerd config that the
    node's containerd really has (its ``config dump``: a CRI section from an
    ``imports`` drop-in replaces the main file's) and whose smr-runtime binary
    exists, read back, not taken from the install step (this also holds when
    SMR_RUNTIME_INSTALL is off and the block is older); and why any other
    is not there ("" when none is missing)."""
    cfg = host / install.CONFIG
    declared = install.block_handlers(cfg.read_text() if cfg.is_file() else "")
    wanted = {n: b for n, b in declared.items()
              if n in HANDLERS and (host / b.lstrip("/")).is_file()}
    if not wanted:
        return [], ""
    try:
        have = install.effective_runtimes(host, "/" + install.CONFIG)
    except (install.NoContainerd, install.ConfigError) as e:
        return [], f"containerd's effective config could not be read ({e})"
    out = [n for n in wanted if not install.missing_handlers(have, {n: wanted[n]})]
    return out, install.missing_handlers(have, wanted) or ""
def labels_for(handlers: list[str]) -> dict[str, str | None]:
    """The merge patch of the node's labels: ``None`` removes a label."""
    return {label(h): "true" if h in handlers else None for h in HANDLERS}


async def publish(core: client.CoreV1Api, node: str, handlers: list[str],
                  why: str = "") -> None:
    """Label ``node`` for exactly ``handlers``; an Event on the Node says so,
    and ``why`` a handler smr's block declares is not there."""
    await core.patch_node(node, {"metadata": {"labels": labels_for(handlers)}},
                          _content_type="application/merge-patch+json")
    if why:
        log.warning("node %s is not labelled for every smr runtime handler: %s", node, why)
    if handlers:
        msg = (f"smr runtime handlers {', '.join(handlers)} installed; labelled "
               f"{', '.join(label(h) for h in handlers)}: opted-in pods can be scheduled here"
               + (f"; not labelled for the others: {why}" if why else ""))
    elif why:
        msg = (f"smr's runtime handlers are in containerd's config file but containerd "
               f"does not have them: {why}; opted-in pods are not scheduled here")
    else:
        msg = ("no smr runtime handler is installed on this node (SMR_RUNTIME_INSTALL=off, "
               "an uninstall, or the install failed: see the smr-agent pod's log); opted-in "
               "pods are not scheduled here")
    await _event(core, node, "SmrRuntimeReady" if handlers else "SmrRuntimeMissing", msg,
                 warning=not handlers or bool(why))


async def _event(core: client.CoreV1Api, node: str, reason: str, message: str,
                 warning: bool) -> None:
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    body: dict[str, Any] = {
        "metadata": {"generateName": f"{node[:200]}.smr-", "namespace": "default"},
        "involvedObject": {"kind": "Node", "apiVersion": "v1", "name": node},
        "reason": reason, "message": message, "type": "Warning" if warning else "Normal",
        "source": {"component": COMPONENT, "host": node}, "reportingComponent": COMPONENT,
        "firstTimestamp": now, "lastTimestamp": now, "count": 1}
    try:
        await core.create_namespaced_event("default", body)
    except ApiException as e:  # the label is what matters; the Event only explains it
        log.warning("cannot post the %s Event on node %s: %s", reason, node, e.reason)


def uninstall(host: Path) -> bool:
    """Remove smr's block from the containerd config and its binaries; True
    if anything was there. Idempotent."""
    changed = False
    cfg = host / install.CONFIG
    if cfg.is_file():
        text = cfg.read_text()
        kept = install._BLOCK.sub("\n", text).rstrip("\n") + "\n"
        if kept != text and install.BEGIN in text:
            changed |= install._write(cfg, kept)
    if (host / install.BIN).exists():
        shutil.rmtree(host / install.BIN)
        changed = True
    return changed


async def install_and_label(s: Settings, core: client.CoreV1Api) -> None:
    """The agent's start-up step: install (or uninstall) the handlers as
    SMR_RUNTIME_INSTALL says, then label the node for what is there."""
    host = Path(s.host_root)
    try:
        if s.runtime_install == "uninstall":
            # The labels go first, so no new pod is placed on a node losing its handler.
            await publish(core, s.node, [])
            if uninstall(host):
                log.info("smr runtime handlers removed from this node")
                await install.restart_containerd()
            return
        if s.runtime_install != "off":
            await install.install_on_node(s.runtime_install, host, Path(s.runtime_binary()),
                                          Path(s.init_binary()), s.agent_wait)
        await publish(core, s.node, *installed_handlers(host))
    except (OSError, RuntimeError, ApiException) as e:
        # Never fatal: the agent still serves the pods already on its node.
        log.error("SMR_RUNTIME_INSTALL=%s on node %s failed: %s; its labels (%s*) may not "
                  "match the handlers it has (docs/node-agent.md)", s.runtime_install, s.node,
                  e, PREFIX)
