"""AsyncClient against a real server: each call agrees with the sync Client's answer to the
same request, and evaluate_many keeps input order under concurrency."""

from __future__ import annotations

import asyncio

import pytest

from fake_judge import expected
from helpers import JUDGE_CASES, QUESTION, STEPS, TEXT
from retrace_client import AsyncClient, Client, InvalidArgument, Verdict
from test_client import assert_same_verdict


@pytest.fixture
def sync(server):
    with Client(server.address) as c:
        yield c


async def test_health_and_list(server):
    async with AsyncClient(server.address) as c:
        assert await c.health() is True
        assert await c.health_status() == "SERVING"
        assert await c.health_status(evaluator="tiny") == "SERVING"
        assert await c.health_status(evaluator="no-such-evaluator") == "SERVICE_UNKNOWN"
        names = sorted(e.name for e in await c.list_evaluators())
    assert names == ["judge", "tiny"]


async def test_evaluate_agrees_with_sync(server, sync):
    async with AsyncClient(server.address) as c:
        a = await c.evaluate(QUESTION, STEPS, id="x")
        b = await c.evaluate(QUESTION, text=TEXT)
        j = await c.evaluate(QUESTION, JUDGE_CASES[1], evaluator="judge")
    assert a.id == "x"
    assert_same_verdict(a, sync.evaluate(QUESTION, STEPS))
    assert_same_verdict(b, sync.evaluate(QUESTION, text=TEXT))
    assert (j.first_error_index, j.category) == expected(JUDGE_CASES[1])


async def test_evaluate_many_agrees_with_sync_stream(server, sync):
    items = [{"question": QUESTION, "steps": [f"{i} * 2 = {2 * i}.", "Done."]} for i in range(40)]
    items.insert(7, {"question": QUESTION, "steps": ["ok", ""]})
    async with AsyncClient(server.address) as c:
        got = await c.evaluate_many(items, max_in_flight=3)
    want = sync.evaluate_many(items)
    assert len(got) == len(items)
    assert isinstance(got[7], InvalidArgument) and "trace.steps[1]" in got[7].message
    for a, b in zip(got, want):
        if isinstance(b, Verdict):
            assert_same_verdict(a, b)
        else:
            assert type(a) is type(b) and a.message == b.message


async def test_concurrent_calls_share_one_client(server, sync):
    async with AsyncClient(server.address) as c:
        results = await asyncio.gather(*(c.evaluate(QUESTION, [f"Step {i}.", "End."]) for i in range(12)))
    for i, v in enumerate(results):
        assert_same_verdict(v, sync.evaluate(QUESTION, [f"Step {i}.", "End."]))


async def test_rank_agrees_with_sync(server, sync):
    candidates = [TEXT, STEPS, ["3*4 = 7.", "2+7 = 9."]]
    async with AsyncClient(server.address) as c:
        a = await c.rank(QUESTION, candidates)
    b = sync.rank(QUESTION, candidates)
    # The first two candidates are one trace (as text and as steps): they tie, and a tie within
    # float noise of the batch they land in may break either way, so compare by candidate.
    assert sorted(a.order) == sorted(b.order) == [0, 1, 2]
    b_by_index = {r.index: r.verdict for r in b.ranked}
    for r in a.ranked:
        assert_same_verdict(r.verdict, b_by_index[r.index])
    scores = [c.verdict.trace_score for c in a.ranked]
    assert scores == sorted(scores, reverse=True)


async def test_errors_raise(server):
    async with AsyncClient(server.address) as c:
        with pytest.raises(InvalidArgument, match=r"trace\.steps\[1\]: is empty"):
            await c.evaluate(QUESTION, ["a", " "])
        with pytest.raises(InvalidArgument, match="unknown evaluator"):
            await c.evaluate(QUESTION, STEPS, evaluator="nope")
