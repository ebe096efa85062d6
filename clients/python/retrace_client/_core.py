"""The half of Client and AsyncClient that never waits: setup, channels, requests, results.

The two clients differ only in how they wait: Client blocks on a grpc channel, AsyncClient
awaits a grpc.aio one, for each answer and between retries.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from . import _requests
from ._batch import Batch
from ._proto import health_service, pb, pb_grpc
from ._transport import DEFAULT_TIMEOUT_S, Attempts, RoundRobin, Settings, channel_options
from .models import EvaluatorInfo, Ranking, Verdict

# A call's `timeout` when the caller gave none: the client's own applies (None means no deadline).
UNSET: Any = object()


@dataclass(frozen=True)
class Unary:
    """One unary call: the Evaluator method, its request, and what turns its response into a result."""

    method: str
    request: Any
    parse: Callable[[Any], Any]


def _evaluator_infos(response) -> list[EvaluatorInfo]:
    return [EvaluatorInfo.from_pb(e) for e in response.evaluators]


def health_name(response) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def health_failure(error: grpc.RpcError) -> str:
    return "SERVICE_UNKNOWN" if error.code() == grpc.StatusCode.NOT_FOUND else "UNREACHABLE"


class Core:
    """The base of Client and AsyncClient; see Client for the arguments."""

    # grpc or grpc.aio: the one thing that differs between the two clients' channels.
    _grpc: Any = None

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
        self._channels: dict[str, Any] = {}
        # A Client is shared across threads; an AsyncClient's one loop never contends for it.
        self._lock = threading.Lock()

    # -- channels -------------------------------------------------------------------------

    def _channel(self, address: str):
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                creds = self.settings.credentials()
                opts = channel_options(address, self.settings.channel_options)
                ch = (
                    self._grpc.secure_channel(address, creds, options=opts)
                    if creds
                    else self._grpc.insecure_channel(address, options=opts)
                )
                self._channels[address] = ch
            return ch

    def _take_channels(self) -> list:
        """Forgets every open channel and returns them, for close() to close."""
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        return channels

    # -- sending: a sync channel returns the response, a grpc.aio one an awaitable --------

    def _attempts(self, timeout: Any) -> Attempts:
        return Attempts(self.settings, self._rr.start(), self.settings.timeout if timeout is UNSET else timeout)

    def _invoke(self, op: Unary, address: str, timeout: float | None):
        stub = pb_grpc.EvaluatorStub(self._channel(address))
        return getattr(stub, op.method)(op.request, timeout=timeout, metadata=self.settings.metadata)

    def _open_stream(self, address: str, requests, timeout: float | None):
        stub = pb_grpc.EvaluatorStub(self._channel(address))
        return stub.EvaluateStream(requests, timeout=timeout, metadata=self.settings.metadata)

    def _health_check(self, address: str | None, evaluator: str | None, timeout: float | None):
        stub = health_pb2_grpc.HealthStub(self._channel(address or self.settings.addresses[0]))
        request = health_pb2.HealthCheckRequest(service=health_service(evaluator))
        return stub.Check(request, timeout=timeout, metadata=self.settings.metadata)

    def _health_addresses(self, address: str | None) -> list[str]:
        return [address] if address else self.settings.addresses

    # -- the calls ------------------------------------------------------------------------

    def _defaulted(self, request):
        """`request`, sent to the client's evaluator when it names none."""
        request.evaluator = request.evaluator or self.settings.evaluator
        return request

    def _evaluate(self, question: str, steps, text, **fields) -> Unary:
        request = _requests.evaluate_request(question, steps, text, **fields)
        return Unary("Evaluate", self._defaulted(request), Verdict.from_pb)

    def _rank(self, question: str, candidates: Iterable[Any], **fields) -> Unary:
        request = _requests.rank_request(question, candidates, **fields)
        return Unary("Rank", self._defaulted(request), Ranking.from_pb)

    def _list_evaluators(self) -> Unary:
        return Unary("ListEvaluators", pb.ListEvaluatorsRequest(), _evaluator_infos)

    def _batch(self, items: Iterable[Any], max_in_flight: int) -> Batch:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        return Batch([self._defaulted(_requests.item_request(it)) for it in items])
