"""The synchronous client: one grpc channel per address, calls with deadline, retries and auth.

Thread-safe: grpc channels and stubs may be shared across threads, and the round-robin counter
is locked. Use it as a context manager, or call close(), to release the channels.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Iterable, Sequence

import grpc

from . import _core
from ._batch import Batch
from ._core import UNSET as _UNSET
from ._core import Core, Unary
from .errors import RetraceError, from_rpc_error
from .models import EvaluatorInfo, Ranking, Verdict


class Client(Core):
    """A retrace client.

    addresses: "host:port", a list of them or a comma-separated string (default
        $RETRACE_ADDRESS, else 127.0.0.1:50051); calls go round-robin, a retry to the next. A
        gRPC target ("dns:///host:port", "ipv4:h1:p1,h2:p2") is one address; an ipv4:/ipv6:
        list gets its first address as authority and round_robin unless channel_options say.
    token: bearer token sent as `authorization: Bearer ...` (default $RETRACE_TOKEN).
    tls / root_certificates: TLS, optionally with a PEM file (path or bytes) of trusted roots.
    timeout: default deadline of a call in seconds, over all its attempts (None: no deadline).
    retries: retries after UNAVAILABLE or RESOURCE_EXHAUSTED (never after other codes). A retry
        waits the server's pushback when the failure carries one (trailing metadata
        `grpc-retry-pushback-ms`, kept as the error's `retry_after`), else a full-jitter backoff
        of up to backoff_initial * 2**n seconds (at most backoff_max); a wait that would end past
        the deadline means no retry, and the error is raised.
    evaluator: evaluator used when a call names none ("" = the server's default).
    """

    _grpc = grpc

    def close(self) -> None:
        for ch in self._take_channels():
            ch.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _unary(self, op: Unary, timeout):
        tries = self._attempts(timeout)
        while True:
            address = tries.begin()
            try:
                return op.parse(self._invoke(op, address, tries.remaining()))
            except grpc.RpcError as e:
                err = from_rpc_error(e, address)
            delay = tries.retry_delay(err)
            if delay is None:
                raise err
            time.sleep(delay)

    # -- the API --------------------------------------------------------------------------

    def evaluate(
        self,
        question: str,
        steps: Sequence[str] | None = None,
        text: str | None = None,
        *,
        options: Sequence[str] | None = None,
        reference_answer: str | None = None,
        evaluator: str = "",
        threshold: float | None = None,
        id: str = "",
        timeout: float | None = _UNSET,
    ) -> Verdict:
        """Judges one trace, given as `steps` or as raw `text` that the server segments."""
        op = self._evaluate(
            question,
            steps,
            text,
            options=options,
            reference_answer=reference_answer,
            evaluator=evaluator,
            threshold=threshold,
            id=id,
        )
        return self._unary(op, timeout)

    def evaluate_many(
        self, items: Iterable[Any], *, max_in_flight: int = 64, timeout: float | None = _UNSET
    ) -> list[Verdict | RetraceError]:
        """Judges many traces over one EvaluateStream, at most `max_in_flight` unanswered at once.

        Results come back in input order: a Verdict, or the RetraceError that item failed with
        (returned, not raised, so one bad item doesn't cost the others)."""
        batch = self._batch(items, max_in_flight)
        if not batch.requests:
            return []
        tries = self._attempts(timeout)
        while batch.start_round(tries):
            err = self._stream_round(tries.address, batch, tries.remaining(), max_in_flight)
            # A failed stream may carry the server's pushback; an item's own error (a message
            # field, not a call's status) never does.
            retry_after = err.retry_after if err is not None else None
            delay = tries.retry_delay(retry_after=retry_after) if batch.end_round(err) else None
            if delay is None:
                break
            time.sleep(delay)
        return batch.results

    def _stream_round(self, address, batch: Batch, timeout, max_in_flight) -> RetraceError | None:
        window = threading.Semaphore(max_in_flight)
        stop = threading.Event()

        def requests():
            # grpc pulls this from its own thread; it waits for a free slot in the window.
            for i in batch.pending:
                while not window.acquire(timeout=0.05):
                    if stop.is_set():
                        return
                if stop.is_set():
                    return
                yield batch.requests[i]

        call = self._open_stream(address, requests(), timeout)
        try:
            for response in call:
                batch.on_response(response, address)
                window.release()
        except grpc.RpcError as e:
            return from_rpc_error(e, address)
        finally:
            stop.set()
            call.cancel()
        return None

    def rank(
        self,
        question: str,
        candidates: Iterable[Any],
        *,
        options: Sequence[str] | None = None,
        reference_answer: str | None = None,
        evaluator: str = "",
        threshold: float | None = None,
        id: str = "",
        timeout: float | None = _UNSET,
    ) -> Ranking:
        """Best-of-N: judges every candidate (raw text, a list of steps, or a mapping with
        `steps`/`text`) for one question and orders them best first."""
        op = self._rank(
            question,
            candidates,
            options=options,
            reference_answer=reference_answer,
            evaluator=evaluator,
            threshold=threshold,
            id=id,
        )
        return self._unary(op, timeout)

    def list_evaluators(self, *, timeout: float | None = _UNSET) -> list[EvaluatorInfo]:
        return self._unary(self._list_evaluators(), timeout)

    def health(
        self, *, address: str | None = None, evaluator: str | None = None, timeout: float | None = 5.0
    ) -> bool:
        """Whether the evaluator service (or one evaluator, by name) reports SERVING: at
        `address`, or at any address."""
        for a in self._health_addresses(address):
            if self.health_status(address=a, evaluator=evaluator, timeout=timeout) == "SERVING":
                return True
        return False

    def health_status(
        self, *, address: str | None = None, evaluator: str | None = None, timeout: float | None = 5.0
    ) -> str:
        """grpc.health.v1's status name at one address (the first by default) for
        retrace.v1.Evaluator, or for `evaluator` alone (retrace.v1.Evaluator/<name>): SERVING,
        NOT_SERVING, SERVICE_UNKNOWN (no such evaluator), or UNREACHABLE when the check fails."""
        try:
            resp = self._health_check(address, evaluator, timeout)
        except grpc.RpcError as e:
            return _core.health_failure(e)
        return _core.health_name(resp)
