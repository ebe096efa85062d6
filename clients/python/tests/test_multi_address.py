"""A gRPC target that lists its own addresses (`ipv4:127.0.0.1:A,127.0.0.1:B`) against two real
servers: calls work without the caller setting grpc.default_authority, whether the target comes
as a string or as one item of a list, spread over both servers, and survive one of them going."""

from __future__ import annotations

import pytest

from conftest import PRM
from helpers import QUESTION, STEPS, requests_total
from retrace_client import AsyncClient, Client
from retrace_client.testing import LocalServer

# Calls until both servers have answered one. Round-robin alternates once both connections are
# up, which happens while the first calls run; the bound only keeps a broken client from looping.
MAX_CALLS = 200


@pytest.fixture(scope="module")
def pair(binary):
    with LocalServer(PRM, binary=binary) as a, LocalServer(PRM, binary=binary) as b:
        yield a, b


def target(*servers: LocalServer) -> str:
    return "ipv4:" + ",".join(s.address for s in servers)


def served(servers) -> list[float]:
    return [requests_total(s, evaluator="tiny", outcome="ok") for s in servers]


@pytest.mark.parametrize("form", ["string", "list"])
def test_a_multi_address_target_answers_from_both_servers(pair, form):
    t = target(*pair)
    before = served(pair)
    with Client(t if form == "string" else [t], retries=0) as c:
        assert c.settings.addresses == [t], "the target's commas are gRPC's, not a list of targets"
        assert c.health() is True
        calls = 0
        while calls < MAX_CALLS:
            v = c.evaluate(QUESTION, STEPS)
            assert [s.text for s in v.steps] == STEPS
            calls += 1
            if all(n > b for n, b in zip(served(pair), before)):
                break
    gained = [n - b for n, b in zip(served(pair), before)]
    assert sum(gained) == calls
    assert all(g > 0 for g in gained), f"calls went {gained}: one server got none"


async def test_the_async_client_takes_the_same_target(pair):
    async with AsyncClient(target(*pair), retries=0) as c:
        assert await c.health() is True
        v = await c.evaluate(QUESTION, STEPS)
    assert [s.text for s in v.steps] == STEPS


def test_calls_go_on_when_one_server_stops(binary):
    with LocalServer(PRM, binary=binary) as a, LocalServer(PRM, binary=binary) as b:
        with Client(target(a, b)) as c:
            c.evaluate(QUESTION, STEPS)
            b.stop()
            # A call that meets the stopped server's closing connection is UNAVAILABLE and
            # retried; the rest go to the live one.
            for _ in range(10):
                assert [s.text for s in c.evaluate(QUESTION, STEPS).steps] == STEPS


def test_channel_options_for_address_lists():
    from retrace_client._transport import channel_options, parse_addresses

    assert channel_options("127.0.0.1:1", ()) == ()
    assert channel_options("ipv4:127.0.0.1:1", ()) == (), "one address: gRPC's own authority is valid"
    assert channel_options("ipv6:[::1]:1,[::1]:2", ()) == (
        ("grpc.default_authority", "[::1]:1"),
        ("grpc.lb_policy_name", "round_robin"),
    )
    # What the caller set stays as set.
    given = (("grpc.default_authority", "retrace.example"), ("grpc.lb_policy_name", "pick_first"))
    assert channel_options("ipv4:10.0.0.1:1,10.0.0.2:1", given) == given
    assert parse_addresses(" IPv4:10.0.0.1:1,10.0.0.2:1 ") == ["IPv4:10.0.0.1:1,10.0.0.2:1"]
    assert parse_addresses("a:1, b:2") == ["a:1", "b:2"], "plain addresses still split"
