"""An agent held to its own node in a changing cluster: nats-server's auth
callout (deploy/kustomize/components/nats-auth/auth-callout.conf, as the dev
overlay renders it) hands each agent's connection to `smr natsauth`
(services/natsauth), which checks the agent's ServiceAccount token with a
TokenReview and gives it a user with agent-node.conf.template's permissions
for the node the token is bound to.

Real: nats-server 2.10 with the callout, the callout service, the bus and a
worker. FAKE: the Kubernetes API server's TokenReview (tests/fake_apiserver.py
answers as the real one does, from tokens the test registers)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest

from services.natsauth import __main__ as natsauth_main
from services.natsauth.callout import NODE_EXTRA, Callout
from services.natsauth.nkeys import KeyPair
from smr import config
from smr.bus import KV_LOCKS, KV_STEPS, KV_TIMINGS, STREAM_REQUESTS, Bus, BusConfig, Worker
from smr.contract.messages import CkptRequested, Target
from tests import nats_auth
from tests.fake_apiserver import FakeApiServer
from tests.helpers.steplocks import node_locks
from tests.test_bus import CountingStep
from tests.test_cluster_security import Client, login, stored

NODE, OTHER_NODE = "node-1", "node-2"
AGENT_SA = "system:serviceaccount:smr-system:smr-agent"


def sa_user(name: str, node: str | None) -> dict[str, object]:
    """A TokenReview's user for a projected, pod-bound token."""
    extra = {"authentication.kubernetes.io/pod-name": ["smr-agent-x"]}
    if node:
        extra[NODE_EXTRA] = [node]
    return {"username": name, "uid": str(uuid.uuid4()),
            "groups": ["system:serviceaccounts", "system:authenticated"], "extra": extra}


@pytest.fixture(scope="module")
def issuer() -> KeyPair:
    return KeyPair.generate("account")


@pytest.fixture(scope="module")
def secured(kustomize: str, tmp_path_factory: pytest.TempPathFactory,
            settings: config.Settings, issuer: KeyPair) -> Iterator[nats_auth.SecuredNats]:
    ship = nats_auth.shipped(kustomize)
    srv = nats_auth.start(settings.nats_server_binary(), tmp_path_factory.mktemp("callout"),
                          ship, tenants={"team-a": "pw-a"}, callout_issuer=issuer.public)
    srv.template = ship.agent_node  # type: ignore[attr-defined]
    yield srv
    srv.stop()


@pytest.fixture
async def callout(secured: nats_auth.SecuredNats, issuer: KeyPair, settings: config.Settings,
                  tmp_path: Path) -> AsyncIterator[tuple[Callout, FakeApiServer]]:
    """`smr natsauth` as its Deployment runs it: its settings, the issuer's seed
    and the agent's template in files (a Secret, the ConfigMap)."""
    kube = await FakeApiServer().start()
    kube.tokens["tok-node-1"] = (sa_user(AGENT_SA, NODE), ["nats"])
    kube.tokens["tok-node-2"] = (sa_user(AGENT_SA, OTHER_NODE), ["nats"])
    kube.tokens["tok-tenant"] = (sa_user("system:serviceaccount:team-a:default", NODE),
                                 ["nats"])
    kube.tokens["tok-unbound"] = (sa_user(AGENT_SA, None), ["nats"])
    kube.tokens["tok-apiserver"] = (sa_user(AGENT_SA, NODE), ["https://kubernetes"])
    (tmp_path / "seed").write_text(issuer.seed)
    (tmp_path / "kube-token").write_text(kube.token("smr-natsauth"))  # its service account
    (tmp_path / "agent-node.conf.template").write_text(secured.template)  # type: ignore[attr-defined]
    s = settings.replace(nats_url=secured.url, nats_user="smr-natsauth",
                         nats_password=secured.passwords["smr-natsauth"], kube_api=kube.url,
                         kube_token_file=str(tmp_path / "kube-token"),
                         nats_callout_seed_file=str(tmp_path / "seed"),
                         nats_agent_template=str(tmp_path / "agent-node.conf.template"))
    svc, cleanups = await natsauth_main.make(None, s)
    task = asyncio.create_task(svc.run())
    await asyncio.wait_for(svc.ready.wait(), 10)
    c = svc.callout  # type: ignore[attr-defined]
    # The storage service's user makes the streams and buckets, as in the cluster.
    setup = await Bus.connect(secured.url, config=secured.config("smr-storage"), buckets=())
    await setup.close()
    try:
        yield c, kube
    finally:
        svc.stop()
        await asyncio.wait_for(task, 10)
        for cleanup in cleanups:
            await cleanup()
        await kube.stop()
    assert not kube.denied, f"a call the shipped RBAC does not grant: {kube.denied}"


async def test_an_agent_gets_its_own_nodes_permissions_only(
        secured: nats_auth.SecuredNats, callout: tuple[Callout, FakeApiServer]) -> None:
    c, _ = callout
    cfg = BusConfig(token="tok-node-1", inbox=f"smr-agent-{NODE}", setup=False)
    bus = await Bus.connect(secured.url, config=cfg, buckets=(KV_LOCKS, KV_STEPS, KV_TIMINGS))
    step = CountingStep()
    admin = await Bus.connect(secured.url, config=secured.config("smr-admin"))
    # Its durables, as the watcher makes them (its user may create none).
    await admin.make_node_consumers(NODE, {step.kind: 1})
    w = Worker(bus, step, NODE, service="agent", locks=node_locks(NODE))
    task = asyncio.create_task(w.run())
    try:
        await asyncio.wait_for(w.idle.wait(), 15)
        assert c.answered[-1] == ("user", f"smr-agent-{NODE}")
        req = CkptRequested(request_id=f"r-{uuid.uuid4().hex[:6]}", checkpoint_id="c",
                            target=Target(kind="pod", namespace="team-a", pod="p",
                                          container="m"), node=NODE)
        done = await admin.request(req, timeout=20)
        assert done.status == "succeeded" and step.seen == [req.request_id]
        # The same connection, for node 2: refused by the server.
        theirs = await admin.ensure_consumer("ckpt.requested", OTHER_NODE)
        errors: list[str] = []

        async def on_error(e: Exception) -> None:
            errors.append(str(e))
        nc = await nats.connect(secured.url, token="tok-node-1", error_cb=on_error,
                                inbox_prefix=f"_INBOX.smr-agent-{NODE}",
                                allow_reconnect=False)
        a = Client(nc, errors)
        try:
            await a.request_refused(f"$JS.API.CONSUMER.MSG.NEXT.{STREAM_REQUESTS}.{theirs}",
                                    b'{"batch": 1}')
            forged = f"ckpt.done.{OTHER_NODE}.team-a"
            await a.publish_refused(forged, b"{}")
            assert await stored(admin, "SMR_EVENTS", forged) == 0
        finally:
            await nc.close()
    finally:
        w.stop()
        await asyncio.wait_for(task, 30)
        await bus.close()
        await admin.close()


@pytest.mark.parametrize("token,why", [
    ("tok-tenant", "is not the node agent's ServiceAccount"),
    ("tok-unbound", "bound to no node"),
    ("tok-apiserver", "not valid"),  # a token for another audience
    ("forged", "not valid"),
    ("", "no token"),
])
async def test_anything_but_an_agents_bound_token_is_refused(
        secured: nats_auth.SecuredNats, callout: tuple[Callout, FakeApiServer],
        token: str, why: str) -> None:
    c, _ = callout
    with pytest.raises(Exception) as refused:
        await nats.connect(secured.url, token=token or None, allow_reconnect=False,
                           max_reconnect_attempts=0, connect_timeout=3)
    assert "authorization" in repr(refused.value).lower() or \
        isinstance(refused.value, nats.errors.NoServersError), repr(refused.value)
    assert c.answered and c.answered[-1][0] == "error" and why in c.answered[-1][1], \
        c.answered


async def test_password_users_bypass_the_callout(
        secured: nats_auth.SecuredNats, callout: tuple[Callout, FakeApiServer]) -> None:
    c, _ = callout
    before = len(c.answered)
    async with login(secured, "tenant-team-a") as a:
        ack = await a.js.publish("ckpt.requested.node-1.team-a", CkptRequested(
            request_id=f"t-{uuid.uuid4().hex[:6]}", checkpoint_id="c", node=NODE,
            target=Target(kind="pod", namespace="team-a", pod="p", container="m")
        ).to_payload())
        assert ack.stream == STREAM_REQUESTS
        await a.publish_refused("ckpt.requested.node-1.team-b")
    assert len(c.answered) == before
