"""gRPC retry pushback: an overloaded answer that carries `grpc-retry-pushback-ms` is retried
after that wait instead of the jittered backoff, never past the call's deadline, by Client and
AsyncClient alike, for unary calls and for evaluate_many's stream.

The server is a stand-in for retrace.v1.Evaluator in this process (no retrace binary needed):
it answers each call from a script of outcomes and notes when each call arrived, so the gap the
client left between attempts is measured where the attempts land.
"""

from __future__ import annotations

import pickle
import threading
import time
from concurrent import futures

import grpc
import pytest

from helpers import QUESTION, STEPS
from retrace_client import AsyncClient, Client, ResourceExhausted, Unavailable, Verdict
from retrace_client._proto import SERVICE, pb
from retrace_client.errors import PUSHBACK_KEY, RetraceError, from_code, retry_pushback

# A jittered backoff capped at BACKOFF_S is well below PUSHBACK_S, so a gap of PUSHBACK_S or
# more between attempts is the pushback's doing, not the backoff's.
PUSHBACK_S = 0.3
BACKOFF_S = 0.02
# Slack for a loaded test machine; an attempt that ignored the pushback comes ~BACKOFF_S late.
SLACK_S = 0.005


class ScriptedEvaluator:
    """Evaluate and EvaluateStream on a free 127.0.0.1 port. Each call takes the next outcome of
    `script` (once it runs out, calls succeed): None answers OK, a (StatusCode, pushback) pair
    fails the call with that code and, when pushback is not None, that `grpc-retry-pushback-ms`
    value."""

    def __init__(self, script):
        self._script = list(script)
        self._lock = threading.Lock()
        self.arrivals: list[float] = []
        handlers = {
            "Evaluate": grpc.unary_unary_rpc_method_handler(
                self._evaluate,
                request_deserializer=pb.EvaluateRequest.FromString,
                response_serializer=pb.EvaluateResponse.SerializeToString,
            ),
            "EvaluateStream": grpc.stream_stream_rpc_method_handler(
                self._evaluate_stream,
                request_deserializer=pb.EvaluateRequest.FromString,
                response_serializer=pb.EvaluateResponse.SerializeToString,
            ),
        }
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"

    def __enter__(self) -> "ScriptedEvaluator":
        self._server.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop(grace=None)

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]

    def _arrive(self, context):
        with self._lock:
            self.arrivals.append(time.monotonic())
            outcome = self._script.pop(0) if self._script else None
        if outcome is not None:
            code, pushback = outcome
            if pushback is not None:
                context.set_trailing_metadata(((PUSHBACK_KEY, pushback),))
            context.abort(code, "the server is busy")

    @staticmethod
    def _answer(request):
        step = pb.StepVerdict(text=STEPS[0], score=0.9)
        return pb.EvaluateResponse(id=request.id, evaluator="scripted", first_error_index=-1, steps=[step],
                                   trace_score=0.9)

    def _evaluate(self, request, context):
        self._arrive(context)
        return self._answer(request)

    def _evaluate_stream(self, requests, context):
        self._arrive(context)
        for request in requests:
            yield self._answer(request)


BUSY_300MS = (grpc.StatusCode.RESOURCE_EXHAUSTED, str(int(PUSHBACK_S * 1000)))


def client_opts(**kw):
    return {"retries": 3, "backoff_initial": BACKOFF_S, "backoff_max": BACKOFF_S, "timeout": 10, **kw}


def test_pushback_is_waited_before_the_retry():
    with ScriptedEvaluator([BUSY_300MS]) as server, Client(server.address, **client_opts()) as c:
        assert isinstance(c.evaluate(QUESTION, STEPS), Verdict)
    (gap,) = server.gaps()
    assert gap >= PUSHBACK_S - SLACK_S, f"the retry came {gap:.3f}s after the first attempt"


async def test_async_pushback_is_waited_before_the_retry():
    with ScriptedEvaluator([BUSY_300MS]) as server:
        async with AsyncClient(server.address, **client_opts()) as c:
            assert isinstance(await c.evaluate(QUESTION, STEPS), Verdict)
    (gap,) = server.gaps()
    assert gap >= PUSHBACK_S - SLACK_S, f"the retry came {gap:.3f}s after the first attempt"


def test_a_failed_stream_waits_its_pushback():
    items = [{"question": QUESTION, "steps": STEPS}] * 3
    with ScriptedEvaluator([BUSY_300MS]) as server, Client(server.address, **client_opts()) as c:
        results = c.evaluate_many(items)
    assert all(isinstance(r, Verdict) for r in results)
    (gap,) = server.gaps()
    assert gap >= PUSHBACK_S - SLACK_S


def test_the_error_carries_the_pushback_when_retries_are_spent():
    with ScriptedEvaluator([BUSY_300MS]) as server, Client(server.address, **client_opts(retries=0)) as c:
        with pytest.raises(ResourceExhausted) as e:
            c.evaluate(QUESTION, STEPS)
    assert e.value.retry_after == pytest.approx(PUSHBACK_S)
    assert len(server.arrivals) == 1


def test_a_pushback_past_the_deadline_is_not_retried():
    # 5 s of pushback against a 1 s deadline: waiting could only end in DEADLINE_EXCEEDED, so
    # the overload itself is raised, at once and after one attempt.
    busy = (grpc.StatusCode.RESOURCE_EXHAUSTED, "5000")
    with ScriptedEvaluator([busy]) as server, Client(server.address, **client_opts(timeout=1.0)) as c:
        t = time.monotonic()
        with pytest.raises(ResourceExhausted) as e:
            c.evaluate(QUESTION, STEPS)
        took = time.monotonic() - t
    assert e.value.retry_after == 5.0
    assert took < 0.5, f"the error took {took:.2f}s to surface"
    assert len(server.arrivals) == 1


async def test_async_pushback_past_the_deadline_is_not_retried():
    busy = (grpc.StatusCode.RESOURCE_EXHAUSTED, "5000")
    with ScriptedEvaluator([busy]) as server:
        async with AsyncClient(server.address, **client_opts(timeout=1.0)) as c:
            t = time.monotonic()
            with pytest.raises(ResourceExhausted):
                await c.evaluate(QUESTION, STEPS)
            took = time.monotonic() - t
    assert took < 0.5, f"the error took {took:.2f}s to surface"
    assert len(server.arrivals) == 1


@pytest.mark.parametrize("code", [grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE])
def test_without_pushback_the_backoff_applies(code):
    # Two failures without pushback: each retry follows within the backoff (plus the machine's
    # latency), far sooner than any pushback here would allow.
    with ScriptedEvaluator([(code, None), (code, None)]) as server, Client(server.address, **client_opts()) as c:
        assert isinstance(c.evaluate(QUESTION, STEPS), Verdict)
    gaps = server.gaps()
    assert len(gaps) == 2
    assert all(g < PUSHBACK_S - SLACK_S for g in gaps), f"gaps {gaps} look like a pushback was waited"


def test_pushback_counts_against_the_retries():
    with ScriptedEvaluator([BUSY_300MS] * 3) as server, Client(server.address, **client_opts(retries=1)) as c:
        with pytest.raises(ResourceExhausted):
            c.evaluate(QUESTION, STEPS)
    assert len(server.arrivals) == 2


def test_pushback_parsing():
    assert retry_pushback(((PUSHBACK_KEY, "300"),)) == pytest.approx(0.3)
    assert retry_pushback([("other", "1"), (PUSHBACK_KEY, b"1500")]) == pytest.approx(1.5)
    assert retry_pushback(((PUSHBACK_KEY, "0"),)) == 0.0
    assert retry_pushback(((PUSHBACK_KEY.upper(), " 20 "),)) == pytest.approx(0.02)
    assert retry_pushback(None) is None
    assert retry_pushback(()) is None
    # Garbage is no pushback (the usual backoff applies), never an error or a negative wait.
    for garbage in ("-300", "abc", "", "1.5", "3e2", "+300", "0x10", "١٢", "300ms", str(2**31), "9" * 40):
        assert retry_pushback(((PUSHBACK_KEY, garbage),)) is None, garbage
    assert retry_pushback(((PUSHBACK_KEY, b"\xff\xfe"),)) is None


def test_retry_after_survives_pickling():
    for error in (from_code("RESOURCE_EXHAUSTED", "busy", "h:1", 0.25),
                  RetraceError("odd", code="ABORTED", retry_after=2.0)):
        back = pickle.loads(pickle.dumps(error))
        assert (type(back), back.code, back.message, back.address, back.retry_after) == (
            type(error), error.code, error.message, error.address, error.retry_after)
    assert pickle.loads(pickle.dumps(Unavailable("down"))).retry_after is None
