"""The auth callout service (nats-server 2.10, ADR-26).

nats-server hands every connection not of its ``auth_users`` to
``$SYS.REQ.USER.AUTH``: a JWT signed by the server, naming what the client
presented (``connect_opts``) and the user nkey it made for it. An agent
presents its projected ServiceAccount token as its NATS token; this service
asks the Kubernetes API who it is (TokenReview), and answers with a user JWT,
signed by the issuer account key the server trusts, whose permissions are
``agent-node.conf.template`` rendered for the node the token is bound to
(``extra["authentication.kubernetes.io/node-name"]``). Anything else is
answered with an error, and the server refuses the connection.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Any

from kubernetes_asyncio import client
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.natsauth.nkeys import KeyPair, decode_jwt, encode_jwt
from smr.bus import node_token

log = logging.getLogger("smr.natsauth")

SUBJECT = "$SYS.REQ.USER.AUTH"
NODE_EXTRA = "authentication.kubernetes.io/node-name"
USER_TTL_S = 3600  # the user JWT's life; the connection is cut when it ends


def permissions(template: str, node: str) -> tuple[list[str], list[str]]:
    """The publish and subscribe subjects of ``agent-node.conf.template`` for
    ``node``: the one definition of an agent's permissions, in the server's
    syntax, read here rather than written twice."""
    body = "\n".join(line for line in template.splitlines()
                     if not line.lstrip().startswith("#"))
    body = body.replace("NODE", node_token(node))
    pub, _, sub = body.partition("subscribe:")
    pub = pub.partition("publish:")[2]
    return re.findall(r'"([^"]+)"', pub), re.findall(r'"([^"]+)"', sub)


@dataclass
class AgentIdentity:
    service_account: str = "system:serviceaccount:smr-system:smr-agent"
    audience: str = "nats"  # of the agent's projected token


class Callout:
    def __init__(self, nc: NATS, auth: client.AuthenticationV1Api, issuer: KeyPair,
                 template: str, *, account: str = "SMR",
                 identity: AgentIdentity | None = None) -> None:
        self.nc, self.auth, self.issuer = nc, auth, issuer
        self.template, self.account = template, account
        self.identity = identity or AgentIdentity()
        self.answered: list[tuple[str, str]] = []  # (user or error), for tests and logs

    async def start(self) -> None:
        await self.nc.subscribe(SUBJECT, queue="smr-natsauth", cb=self._answer)

    async def _answer(self, m: Msg) -> None:
        try:
            req = decode_jwt(m.data.decode(), "server")["nats"]
        except ValueError as e:
            log.warning("auth callout: a request not signed by a server: %s", e)
            return  # no answer: the server times the connection out
        user_nkey, server = req["user_nkey"], req["server_id"]["id"]
        try:
            node = await self._node(req.get("connect_opts") or {})
            pub, sub = permissions(self.template, node)
            now = int(time.time())
            user = encode_jwt({
                "sub": user_nkey, "aud": self.account, "name": f"smr-agent-{node_token(node)}",
                "iat": now, "exp": now + USER_TTL_S,
                "nats": {"pub": {"allow": pub}, "sub": {"allow": sub}, "subs": -1,
                         "data": -1, "payload": -1, "type": "user", "version": 2}},
                self.issuer)
            answer: dict[str, Any] = {"jwt": user}
            self.answered.append(("user", f"smr-agent-{node_token(node)}"))
        except PermissionError as e:
            answer = {"error": str(e)}
            self.answered.append(("error", str(e)))
            log.warning("auth callout: refused a connection from %s: %s",
                        (req.get("client_info") or {}).get("host"), e)
        await m.respond(encode_jwt({
            "sub": user_nkey, "aud": server,
            "nats": {**answer, "type": "authorization_response", "version": 2}},
            self.issuer).encode())

    async def _node(self, opts: dict[str, Any]) -> str:
        """The node of the agent whose ServiceAccount token this is."""
        token = opts.get("auth_token")
        if not token:
            raise PermissionError("no token: an agent logs in with its ServiceAccount token")
        review = await self.auth.create_token_review(client.V1TokenReview(
            spec=client.V1TokenReviewSpec(token=token, audiences=[self.identity.audience])))
        st = review.status
        if not st or not st.authenticated or not st.user:
            raise PermissionError(f"the token is not valid: {st.error if st else 'no status'}")
        if st.user.username != self.identity.service_account:
            raise PermissionError(f"{st.user.username} is not the node agent's ServiceAccount")
        nodes = (st.user.extra or {}).get(NODE_EXTRA) or []
        if len(nodes) != 1:
            raise PermissionError("the token is bound to no node (a projected, pod-bound "
                                  "ServiceAccount token names one)")
        return str(nodes[0])
