"""A real nats-server with the NATS users and permissions that deploy/kustomize
ships: accounts.conf as the dev overlay renders it (the ConfigMap
smr-nats-accounts), the passwords of its Secret smr-nats-users, and users
rendered from its templates (tenants, per-node agents). No second copy of
the permissions lives in the tests."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from smr.bus import Bus, BusConfig, node_token
from smr.config import REPO_TOOLS
from smr.contract.errors import SmrError
from smr.natsserver import NatsServer
from tests import deploy_render

MARKER = "      # smr: tenant and per-node agent users go here"
SERVICES = ("storage", "watcher", "agent", "webhook", "admin", "natsauth")


@dataclass
class Shipped:
    accounts: str
    tenant: str  # tenant.conf.template
    agent_node: str  # agent-node.conf.template
    callout: str  # auth-callout.conf
    local_node: str  # local-node.conf.template: `smr up` on a shared NATS
    passwords: dict[str, str]  # Secret smr-nats-users: service → password


def kustomize() -> str:
    """The kustomize binary (`make setup` puts it in .tools/bin)."""
    found = REPO_TOOLS / "kustomize"
    if found.exists():
        return str(found)
    if path := shutil.which("kustomize"):
        return path
    raise SmrError("kustomize is not installed: it renders the shipped NATS users",
                   code="config-invalid", hint="make setup")


def shipped(kustomize: str) -> Shipped:
    docs = deploy_render.render(kustomize, "dev")
    cm = next(d for d in docs if d["kind"] == "ConfigMap"
              and d["metadata"]["name"] == "smr-nats-accounts")["data"]
    secret = next(d for d in docs if d["kind"] == "Secret"
                  and d["metadata"]["name"] == "smr-nats-users")
    pw = {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}
    pw.update(secret.get("stringData", {}))
    return Shipped(cm["accounts.conf"], cm["tenant.conf.template"],
                   cm["agent-node.conf.template"], cm["auth-callout.conf"],
                   cm["local-node.conf.template"], pw)


def _user(template: str, placeholder: str, value: str, password: str) -> str:
    body = "\n".join(line for line in template.splitlines() if not line.startswith("#"))
    return body.replace(placeholder, value).replace("PASSWORD", password)


@dataclass
class SecuredNats:
    """The server, and how each user logs in to it."""

    server: NatsServer
    passwords: dict[str, str] = field(default_factory=dict)  # user → password
    users: _Users | None = None  # what it was started with (``start``)

    @property
    def url(self) -> str:
        return self.server.url

    def config(self, user: str, **kw: object) -> BusConfig:
        return config(user, self.passwords[user], **kw)

    async def connect(self, user: str, base: BusConfig | None = None,
                      buckets: Iterable[str] | None = None) -> Bus:
        """A Bus logged in as ``user``, with ``base``'s other settings;
        ``buckets``: those its service binds (the others it may not read)."""
        cfg = config(user, self.passwords[user])
        if base:
            cfg = replace(base, user=cfg.user, password=cfg.password, setup=cfg.setup)
        return await Bus.connect(self.url, name=user, config=cfg, buckets=buckets)

    def node_user(self, node: str) -> str:
        """The user `smr up` on machine ``node`` logs in as
        (local-node.conf.template, held to that node), added to the running
        server where the test did not start it with one: a second node of a
        migration, a node a test names itself. The server reloads its
        configuration (SIGHUP), as an operator's does on adding a machine."""
        user = f"smr-node-{node_token(node)}"
        if user in self.passwords:
            return user
        assert self.users is not None, "a server of nats_auth.start adds users"
        assert self.server.proc is not None and self.server.proc.poll() is None
        self.users.nodes[node] = uuid.uuid4().hex
        _, _, self.passwords = self.users.write()
        before = self._reloads()
        self.server.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 15
        while self._reloads() == before:
            if time.monotonic() > deadline:
                raise SmrError(f"nats-server did not reload its users to add {user}",
                               code="nats-start-failed", hint=f"see {self.server.log_file}")
            time.sleep(0.02)
        return user

    def _reloads(self) -> int:
        """How many reloads the server's log reports; one that failed is an error."""
        text = self.server.log_file.read_text(errors="replace")
        if "Failed to reload" in text:
            bad = [ln for ln in text.splitlines() if "Failed to reload" in ln]
            raise SmrError("nats-server refused its reloaded configuration",
                           code="config-invalid", detail=bad[-1])
        return text.count("Reloaded server configuration")

    def violations(self) -> list[str]:
        """The server's log lines for what it refused a client (publish,
        subscribe, login): where the test's own clients are smr's services,
        each is a permission a deployed cluster would refuse them too."""
        try:
            text = self.server.log_file.read_text(errors="replace")
        except FileNotFoundError:
            return []
        return [line for line in text.splitlines() if "Violation" in line]

    def stop(self) -> None:
        self.server.stop()


@dataclass
class Rendered:
    """accounts.conf with the extra users, where a server reads it, and the
    environment it reads the services' passwords from."""

    conf: Path
    env: dict[str, str]
    passwords: dict[str, str]  # user → password


def render(store: Path, ship: Shipped, *, tenants: Mapping[str, str] = {},
           agents: Mapping[str, str] = {}, nodes: Mapping[str, str] = {}) -> Rendered:
    """``tenants``: namespace → password; ``agents``: node → password (a user
    each, from the templates); ``nodes``: machine → password, a user each from
    local-node.conf.template (`smr up` on a shared NATS)."""
    assert MARKER in ship.accounts, "accounts.conf lost the line extra users go after"
    extra = [_user(ship.tenant, "NAMESPACE", node_token(ns), pw) for ns, pw in tenants.items()]
    extra += [_user(ship.agent_node, "NODE", node_token(n), pw) for n, pw in agents.items()]
    extra += [_user(ship.local_node, "NODE", node_token(n), pw) for n, pw in nodes.items()]
    store.mkdir(parents=True, exist_ok=True)
    conf = store / "accounts.conf"
    conf.write_text(ship.accounts.replace(MARKER, "\n".join(extra) + "\n" + MARKER))
    env = {**os.environ, **{f"SMR_NATS_PASSWORD_{s.upper()}": ship.passwords[s]
                            for s in SERVICES}}
    users = {f"smr-{s}": ship.passwords[s] for s in SERVICES}
    users.update({f"tenant-{node_token(ns)}": pw for ns, pw in tenants.items()})
    users.update({f"smr-agent-{node_token(n)}": pw for n, pw in agents.items()})
    users.update({f"smr-node-{node_token(n)}": pw for n, pw in nodes.items()})
    return Rendered(conf, env, users)


def config(user: str, password: str, **kw: object) -> BusConfig:
    """How ``user`` logs in: only the storage service and operators create
    the streams and buckets (SMR_NATS_SETUP), as deployed."""
    return BusConfig(user=user, password=password,
                     setup=user in ("smr-storage", "smr-admin"), **kw)  # type: ignore[arg-type]


def start(binary: str, store: Path, ship: Shipped, *, tenants: Mapping[str, str] = {},
          agents: Mapping[str, str] = {}, nodes: Mapping[str, str] = {},
          callout_issuer: str = "") -> SecuredNats:
    """``tenants``, ``agents``, ``nodes``: as for ``render``. ``callout_issuer``:
    run auth-callout.conf with this issuer (an account public nkey) instead
    of accounts.conf alone."""
    users = _Users(store, ship, dict(tenants), dict(agents), dict(nodes), callout_issuer)
    conf, env, passwords = users.write()
    server = NatsServer(binary, users.js, extra_args=["-c", str(conf)], env=env,
                        jetstream_flags=False).start()
    return SecuredNats(server, passwords, users)


@dataclass
class _Users:
    """The users a server was started with, to render its configuration again
    with one more (``SecuredNats.node_user``)."""

    store: Path
    ship: Shipped
    tenants: dict[str, str]
    agents: dict[str, str]
    nodes: dict[str, str]
    callout_issuer: str

    def write(self) -> tuple[Path, dict[str, str], dict[str, str]]:
        """The configuration the server reads, its environment, and each user's password."""
        r = render(self.store, self.ship, tenants=self.tenants, agents=self.agents,
                   nodes=self.nodes)
        conf, env = r.conf, r.env
        if self.callout_issuer:
            names = [f"tenant-{node_token(ns)}" for ns in self.tenants]
            names += [f"smr-agent-{node_token(n)}" for n in self.agents]
            assert "auth_users: [" in self.ship.callout
            (self.store / "auth-callout.conf").write_text(self.ship.callout.replace(
                "auth_users: [", "auth_users: [" + "".join(f"{n}, " for n in names)))
            conf = self.store / "auth-callout.conf"
            env["SMR_NATS_CALLOUT_ISSUER"] = self.callout_issuer
        # JetStream in the file, not on the command line (-js, as the deploy
        # runs it): nats-server 2.10 forgets the flags on a reload and shuts
        # JetStream down (nats-io/nats-server#6606), and node_user reloads.
        server = self.store / "server.conf"
        server.write_text(f"include ./{conf.name}\n"
                          f"jetstream {{ store_dir: {json.dumps(str(self.js))} }}\n")
        return server, env, r.passwords

    @property
    def js(self) -> Path:
        """The server's store directory (and its log's)."""
        return self.store / "js"
