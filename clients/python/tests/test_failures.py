"""Failure semantics against real servers: status mapping, which codes are retried (counted in
the server's own retrace_requests_total), round-robin past a dead address, deadlines, bearer
auth and TLS."""

from __future__ import annotations

import pickle
import threading
import time

import pytest

from conftest import TOKENS
from helpers import QUESTION, STEPS, requests_total
from retrace_client import (
    AsyncClient,
    Client,
    DeadlineExceeded,
    InvalidArgument,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    Verdict,
)
from retrace_client.testing import free_port


@pytest.fixture
def dead() -> str:
    return f"127.0.0.1:{free_port()}"


def test_invalid_argument_names_the_field_and_is_not_retried(server):
    before = requests_total(server, rpc="Evaluate", outcome="invalid_argument")
    with Client(server.address, retries=3) as c, pytest.raises(InvalidArgument) as e:
        c.evaluate(QUESTION, ["fine", " "])
    assert e.value.code == "INVALID_ARGUMENT"
    assert e.value.message == "trace.steps[1]: is empty"
    assert e.value.address == server.address
    assert requests_total(server, rpc="Evaluate", outcome="invalid_argument") == before + 1


def test_unknown_evaluator(server):
    with Client(server.address) as c, pytest.raises(InvalidArgument) as e:
        c.evaluate(QUESTION, STEPS, evaluator="gpt-17")
    assert "gpt-17" in e.value.message and "tiny" in e.value.message


def test_error_survives_pickling():
    e = pickle.loads(pickle.dumps(InvalidArgument("trace.question: is required", address="h:1")))
    assert (type(e), e.code, e.message, e.address) == (
        InvalidArgument, "INVALID_ARGUMENT", "trace.question: is required", "h:1")


def test_round_robin_moves_past_a_dead_address(server, dead):
    # Without retries, the call that starts at the dead address fails, the next one (which
    # starts at the live address) succeeds: calls go round-robin.
    with Client([dead, server.address], retries=0) as c:
        with pytest.raises(Unavailable) as e:
            c.evaluate(QUESTION, STEPS)
        assert e.value.address == dead
        assert isinstance(c.evaluate(QUESTION, STEPS), Verdict)
    # With a retry, the call starting at the dead address moves on to the live one.
    with Client(f"{dead},{server.address}", retries=1, backoff_initial=0.01) as c:
        for _ in range(4):
            assert isinstance(c.evaluate(QUESTION, STEPS), Verdict)
        assert all(isinstance(v, Verdict) for v in c.evaluate_many([{"question": QUESTION, "steps": STEPS}] * 5))


async def test_async_round_robin_moves_past_a_dead_address(server, dead):
    async with AsyncClient([dead, server.address], retries=1, backoff_initial=0.01) as c:
        for _ in range(3):
            assert isinstance(await c.evaluate(QUESTION, STEPS), Verdict)
        results = await c.evaluate_many([{"question": QUESTION, "steps": STEPS}] * 5)
        assert all(isinstance(v, Verdict) for v in results)


def test_all_dead_gives_unavailable_after_retries(dead):
    with Client([dead], retries=2, backoff_initial=0.01) as c:
        assert c.health() is False and c.health_status() == "UNREACHABLE"
        with pytest.raises(Unavailable):
            c.evaluate(QUESTION, STEPS)
        results = c.evaluate_many([{"question": QUESTION, "steps": STEPS}] * 3)
        assert all(isinstance(r, Unavailable) for r in results)


def _hold_the_only_slot(address: str) -> threading.Thread:
    """Occupies a max_in_flight = 1 server with a judge request the fake answers slowly."""

    def run():
        with Client(address, timeout=30) as c:
            c.evaluate("SLOW question", ["a.", "b."], evaluator="judge")

    t = threading.Thread(target=run)
    t.start()
    return t


def _wait_admitted(server) -> None:
    until = time.monotonic() + 10
    while time.monotonic() < until:
        # The slow request is in once a probe is refused for overload.
        with Client(server.address, retries=0) as c:
            try:
                c.evaluate(QUESTION, STEPS, evaluator="judge")
            except ResourceExhausted:
                return
        time.sleep(0.05)
    raise AssertionError("the slow request never took the server's only slot")


def test_resource_exhausted_is_retried_until_admitted(tight_server):
    holder = _hold_the_only_slot(tight_server.address)
    try:
        _wait_admitted(tight_server)
        with Client(tight_server.address, retries=0) as c, pytest.raises(ResourceExhausted):
            c.evaluate(QUESTION, STEPS, evaluator="judge")
        before = requests_total(tight_server, outcome="resource_exhausted")
        # Jittered backoff of up to 0.4 s, 40 times, outlasts the 3 s the slot is held.
        with Client(tight_server.address, retries=40, backoff_initial=0.2, backoff_max=0.4, timeout=30) as c:
            v = c.evaluate(QUESTION, STEPS, evaluator="judge")
        assert v.first_error_index == -1
        assert requests_total(tight_server, outcome="resource_exhausted") >= before + 1
    finally:
        holder.join()


def test_deadline_exceeded_on_a_slow_judge(server):
    with Client(server.address, timeout=30) as c:
        t = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            c.evaluate("SLOW question", STEPS, evaluator="judge", timeout=0.5)
        assert time.monotonic() - t < 2.5
        # The per-call timeout applies to one call only; the client default stays.
        assert isinstance(c.evaluate(QUESTION, STEPS), Verdict)


def test_deadline_in_evaluate_many_marks_unfinished_items(server):
    items = [{"question": QUESTION, "steps": STEPS},
             {"question": "SLOW question", "steps": STEPS, "evaluator": "judge"}]
    with Client(server.address) as c:
        t = time.monotonic()
        results = c.evaluate_many(items, timeout=1.0)
        assert time.monotonic() - t < 2.5
    assert isinstance(results[0], Verdict)
    assert isinstance(results[1], DeadlineExceeded)


async def test_async_deadline(server):
    async with AsyncClient(server.address, timeout=0.5) as c:
        with pytest.raises(DeadlineExceeded):
            await c.evaluate("SLOW question", STEPS, evaluator="judge")


def test_the_deadline_bounds_retries(dead):
    with Client([dead], retries=1000, backoff_initial=0.05, backoff_max=0.1, timeout=1.0) as c:
        t = time.monotonic()
        with pytest.raises((Unavailable, DeadlineExceeded)):
            c.evaluate(QUESTION, STEPS)
        assert time.monotonic() - t < 2.0


def test_bearer_token(auth_server, monkeypatch):
    monkeypatch.delenv("RETRACE_TOKEN", raising=False)
    with Client(auth_server.address) as c:
        # The health service stays open without a token.
        assert c.health()
        with pytest.raises(Unauthenticated):
            c.evaluate(QUESTION, STEPS)
        results = c.evaluate_many([{"question": QUESTION, "steps": STEPS}] * 2)
        assert all(isinstance(r, Unauthenticated) for r in results)
    with Client(auth_server.address, token="not-a-token") as c, pytest.raises(Unauthenticated):
        c.list_evaluators()
    for token in TOKENS:
        with Client(auth_server.address, token=token) as c:
            assert isinstance(c.evaluate(QUESTION, STEPS), Verdict)
            assert [e.name for e in c.list_evaluators()] == ["tiny"]
    monkeypatch.setenv("RETRACE_TOKEN", TOKENS[1])
    with Client(auth_server.address) as c:
        assert isinstance(c.evaluate(QUESTION, STEPS), Verdict)


async def test_async_bearer_token(auth_server, monkeypatch):
    monkeypatch.delenv("RETRACE_TOKEN", raising=False)
    async with AsyncClient(auth_server.address) as c:
        with pytest.raises(Unauthenticated):
            await c.evaluate(QUESTION, STEPS)
    async with AsyncClient(auth_server.address, token=TOKENS[0]) as c:
        ranking = await c.rank(QUESTION, [STEPS, STEPS])
    assert sorted(ranking.order) == [0, 1]


def test_tls(tls_server, tls_files):
    _, _, ca = tls_files
    with Client(tls_server.address, root_certificates=str(ca)) as c:
        assert c.health()
        assert isinstance(c.evaluate(QUESTION, STEPS), Verdict)
    # Without the test CA the certificate is not trusted; plaintext is refused.
    with Client(tls_server.address, tls=True, retries=0, timeout=5) as c, pytest.raises(Unavailable):
        c.evaluate(QUESTION, STEPS)
    with Client(tls_server.address, retries=0, timeout=5) as c, pytest.raises(Unavailable):
        c.evaluate(QUESTION, STEPS)


async def test_async_tls(tls_server, tls_files):
    _, _, ca = tls_files
    async with AsyncClient(tls_server.address, root_certificates=ca.read_bytes()) as c:
        assert isinstance(await c.evaluate(QUESTION, STEPS), Verdict)


def test_evaluate_many_retries_items_refused_for_overload(tight_server):
    # Two slow items on a server that admits one request at a time: the second is refused
    # with RESOURCE_EXHAUSTED inside the stream, and goes out again until it is admitted.
    items = [{"question": f"SLOW question {i}", "steps": ["a.", "b."], "evaluator": "judge"} for i in range(2)]
    before = requests_total(tight_server, outcome="resource_exhausted")
    with Client(tight_server.address, retries=40, backoff_initial=0.2, backoff_max=0.4, timeout=60) as c:
        results = c.evaluate_many(items, max_in_flight=2)
    assert all(isinstance(r, Verdict) and r.first_error_index == -1 for r in results)
    assert requests_total(tight_server, outcome="resource_exhausted") >= before + 1
