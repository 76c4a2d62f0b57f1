"""The ports smr hands a server it starts (nats-server: its client, route
and monitoring ports; the tests' servers likewise): free now, and out of the
kernel's reach until the server binds them."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from smr import natsserver
from smr.natsserver import free_port


def test_a_port_handed_out_is_below_the_range_outgoing_connections_take_from() -> None:
    """Every outgoing connection and bind(0) takes its port from the
    ephemeral range: a port picked there can be taken before its server
    binds it (a route port of a test's NATS cluster was)."""
    low = natsserver._ephemeral_low()
    if low - natsserver._LOWEST <= 1000:
        pytest.skip(f"ip_local_port_range starts at {low}: no room below it")
    ports = [free_port() for _ in range(20)]
    assert all(natsserver._LOWEST <= p < low for p in ports), ports
    assert len(set(ports)) == len(ports), "a port handed out twice"


def test_a_port_in_use_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        picks = iter([taken, taken])

        class Picks:
            def randrange(self, *_: Any) -> int:
                return next(picks, 23456)

        monkeypatch.setattr(natsserver.random, "SystemRandom", Picks)
        monkeypatch.setattr(natsserver, "_ephemeral_low", lambda: 32768)
        monkeypatch.setattr(natsserver, "_GIVEN", {})
        port = free_port()
        assert port != taken
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_where_no_port_lies_below_that_range_none_is_handed_out_twice(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """ip_local_port_range from 1024: the kernel picks, and a port handed
    out a moment ago (its server not bound yet) is not handed out again."""
    monkeypatch.setattr(natsserver, "_ephemeral_low", lambda: 1024)
    monkeypatch.setattr(natsserver, "_GIVEN", {})
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
