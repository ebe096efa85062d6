"""The synchronous client: one grpc channel per address, calls with deadline, retries and auth.

Thread-safe: grpc channels and stubs may be shared across threads, and the round-robin counter
is locked. Use it as a context manager, or call close(), to release the channels.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Iterable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from . import _requests
from ._batch import Batch
from ._proto import health_service, pb, pb_grpc
from ._transport import DEFAULT_TIMEOUT_S, Deadline, RoundRobin, Settings, channel_options
from .errors import DeadlineExceeded, RetraceError, from_rpc_error
from .models import EvaluatorInfo, Ranking, Verdict

_UNSET: Any = object()


class Client:
    """A retrace client.

    addresses: "host:port", a list of them or a comma-separated string (default
        $RETRACE_ADDRESS, else 127.0.0.1:50051); calls go round-robin, a retry to the next. A
        gRPC target ("dns:///host:port", "ipv4:h1:p1,h2:p2") is one address; an ipv4:/ipv6:
        list gets its first address as authority and round_robin unless channel_options say.
    token: bearer token sent as `authorization: Bearer ...` (default $RETRACE_TOKEN).
    tls / root_certificates: TLS, optionally with a PEM file (path or bytes) of trusted roots.
    timeout: default deadline of a call in seconds, over all its attempts (None: no deadline).
    retries: retries after UNAVAILABLE or RESOURCE_EXHAUSTED (never after other codes).
    evaluator: evaluator used when a call names none ("" = the server's default).
    """

    def __init__(
        self,
        addresses: str | Sequence[str] | None = None,
        *,
        token: str | None = None,
        tls: bool = False,
        root_certificates: str | bytes | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        retries: int = 3,
        backoff_initial: float = 0.1,
        backoff_max: float = 2.0,
        evaluator: str = "",
        channel_options: Sequence[tuple] = (),
    ):
        self.settings = Settings.build(
            addresses,
            token=token,
            tls=tls,
            root_certificates=root_certificates,
            timeout=timeout,
            retries=retries,
            backoff_initial=backoff_initial,
            backoff_max=backoff_max,
            evaluator=evaluator,
            channel_options=channel_options,
        )
        self._rr = RoundRobin(len(self.settings.addresses))
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    # -- channels -------------------------------------------------------------------------

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                creds = self.settings.credentials()
                opts = channel_options(address, self.settings.channel_options)
                ch = (
                    grpc.secure_channel(address, creds, options=opts)
                    if creds
                    else grpc.insecure_channel(address, options=opts)
                )
                self._channels[address] = ch
            return ch

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            ch.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the retry loop -------------------------------------------------------------------

    def _timeout(self, timeout: Any) -> float | None:
        return self.settings.timeout if timeout is _UNSET else timeout

    def _unary(self, method: str, request, timeout):
        s = self.settings
        deadline = Deadline(self._timeout(timeout))
        start = self._rr.start()
        attempt = 0
        while True:
            address = s.addresses[(start + attempt) % len(s.addresses)]
            if deadline.expired():
                raise DeadlineExceeded("the call's deadline passed before an attempt could start", address=address)
            stub = pb_grpc.EvaluatorStub(self._channel(address))
            try:
                return getattr(stub, method)(request, timeout=deadline.remaining(), metadata=s.metadata)
            except grpc.RpcError as e:
                err = from_rpc_error(e, address)
            delay = s.backoff(attempt)
            if not err.retryable or attempt >= s.retries or not deadline.allows_sleep(delay):
                raise err
            time.sleep(delay)
            attempt += 1

    def _evaluator(self, evaluator: str) -> str:
        return evaluator or self.settings.evaluator

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
        req = _requests.evaluate_request(
            question,
            steps,
            text,
            options=options,
            reference_answer=reference_answer,
            evaluator=self._evaluator(evaluator),
            threshold=threshold,
            id=id,
        )
        return Verdict.from_pb(self._unary("Evaluate", req, timeout))

    def evaluate_many(
        self, items: Iterable[Any], *, max_in_flight: int = 64, timeout: float | None = _UNSET
    ) -> list[Verdict | RetraceError]:
        """Judges many traces over one EvaluateStream, at most `max_in_flight` unanswered at once.

        Results come back in input order: a Verdict, or the RetraceError that item failed with
        (returned, not raised, so one bad item doesn't cost the others)."""
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        reqs = [_requests.item_request(it) for it in items]
        for r in reqs:
            r.evaluator = self._evaluator(r.evaluator)
        batch = Batch(reqs)
        if not reqs:
            return []
        s = self.settings
        deadline = Deadline(self._timeout(timeout))
        start = self._rr.start()
        attempt = 0
        while True:
            address = s.addresses[(start + attempt) % len(s.addresses)]
            if deadline.expired():
                batch.fail_pending(DeadlineExceeded("the call's deadline passed", address=address))
                break
            err = self._stream_round(address, batch, deadline.remaining(), max_in_flight)
            if not batch.end_round(err):
                break
            delay = s.backoff(attempt)
            if attempt >= s.retries or not deadline.allows_sleep(delay):
                break
            time.sleep(delay)
            attempt += 1
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

        stub = pb_grpc.EvaluatorStub(self._channel(address))
        call = stub.EvaluateStream(requests(), timeout=timeout, metadata=self.settings.metadata)
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
        req = _requests.rank_request(
            question,
            candidates,
            options=options,
            reference_answer=reference_answer,
            evaluator=self._evaluator(evaluator),
            threshold=threshold,
            id=id,
        )
        return Ranking.from_pb(self._unary("Rank", req, timeout))

    def list_evaluators(self, *, timeout: float | None = _UNSET) -> list[EvaluatorInfo]:
        resp = self._unary("ListEvaluators", pb.ListEvaluatorsRequest(), timeout)
        return [EvaluatorInfo.from_pb(e) for e in resp.evaluators]

    def health(
        self, *, address: str | None = None, evaluator: str | None = None, timeout: float | None = 5.0
    ) -> bool:
        """Whether the evaluator service (or one evaluator, by name) reports SERVING: at
        `address`, or at any address."""
        for a in [address] if address else self.settings.addresses:
            if self.health_status(address=a, evaluator=evaluator, timeout=timeout) == "SERVING":
                return True
        return False

    def health_status(
        self, *, address: str | None = None, evaluator: str | None = None, timeout: float | None = 5.0
    ) -> str:
        """grpc.health.v1's status name at one address (the first by default) for
        retrace.v1.Evaluator, or for `evaluator` alone (retrace.v1.Evaluator/<name>): SERVING,
        NOT_SERVING, SERVICE_UNKNOWN (no such evaluator), or UNREACHABLE when the check fails."""
        stub = health_pb2_grpc.HealthStub(self._channel(address or self.settings.addresses[0]))
        try:
            resp = stub.Check(
                health_pb2.HealthCheckRequest(service=health_service(evaluator)),
                timeout=timeout,
                metadata=self.settings.metadata,
            )
        except grpc.RpcError as e:
            return "SERVICE_UNKNOWN" if e.code() == grpc.StatusCode.NOT_FOUND else "UNREACHABLE"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
