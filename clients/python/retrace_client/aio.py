"""The asyncio client (grpc.aio): the same calls, options and retry policy as Client.

grpc.aio channels belong to the event loop they were first used in, so an AsyncClient is for
one loop: create it (or at least first call it) inside the loop that will use it, and
`await client.close()` (or `async with`) when done.
"""

from __future__ import annotations

import asyncio
from typing import Any, Iterable, Sequence

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from . import _requests
from ._batch import Batch
from ._proto import health_service, pb, pb_grpc
from ._transport import DEFAULT_TIMEOUT_S, Deadline, RoundRobin, Settings, channel_options
from .errors import DeadlineExceeded, RetraceError, from_rpc_error
from .models import EvaluatorInfo, Ranking, Verdict

_UNSET: Any = object()


class AsyncClient:
    """See Client for the arguments; every call is a coroutine."""

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
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            creds = self.settings.credentials()
            opts = channel_options(address, self.settings.channel_options)
            ch = (
                grpc.aio.secure_channel(address, creds, options=opts)
                if creds
                else grpc.aio.insecure_channel(address, options=opts)
            )
            self._channels[address] = ch
        return ch

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            await ch.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _timeout(self, timeout: Any) -> float | None:
        return self.settings.timeout if timeout is _UNSET else timeout

    def _evaluator(self, evaluator: str) -> str:
        return evaluator or self.settings.evaluator

    async def _unary(self, method: str, request, timeout):
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
                return await getattr(stub, method)(request, timeout=deadline.remaining(), metadata=s.metadata)
            except grpc.RpcError as e:
                err = from_rpc_error(e, address)
            delay = s.backoff(attempt)
            if not err.retryable or attempt >= s.retries or not deadline.allows_sleep(delay):
                raise err
            await asyncio.sleep(delay)
            attempt += 1

    async def evaluate(
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
        return Verdict.from_pb(await self._unary("Evaluate", req, timeout))

    async def evaluate_many(
        self, items: Iterable[Any], *, max_in_flight: int = 64, timeout: float | None = _UNSET
    ) -> list[Verdict | RetraceError]:
        """As Client.evaluate_many: one stream, bounded in flight, results in input order."""
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
            err = await self._stream_round(address, batch, deadline.remaining(), max_in_flight)
            if not batch.end_round(err):
                break
            delay = s.backoff(attempt)
            if attempt >= s.retries or not deadline.allows_sleep(delay):
                break
            await asyncio.sleep(delay)
            attempt += 1
        return batch.results

    async def _stream_round(self, address, batch: Batch, timeout, max_in_flight) -> RetraceError | None:
        window = asyncio.Semaphore(max_in_flight)

        async def requests():
            for i in batch.pending:
                await window.acquire()
                yield batch.requests[i]

        stub = pb_grpc.EvaluatorStub(self._channel(address))
        call = stub.EvaluateStream(requests(), timeout=timeout, metadata=self.settings.metadata)
        try:
            async for response in call:
                batch.on_response(response, address)
                window.release()
        except grpc.RpcError as e:
            return from_rpc_error(e, address)
        finally:
            call.cancel()
        return None

    async def rank(
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
        req = _requests.rank_request(
            question,
            candidates,
            options=options,
            reference_answer=reference_answer,
            evaluator=self._evaluator(evaluator),
            threshold=threshold,
            id=id,
        )
        return Ranking.from_pb(await self._unary("Rank", req, timeout))

    async def list_evaluators(self, *, timeout: float | None = _UNSET) -> list[EvaluatorInfo]:
        resp = await self._unary("ListEvaluators", pb.ListEvaluatorsRequest(), timeout)
        return [EvaluatorInfo.from_pb(e) for e in resp.evaluators]

    async def health(
        self, *, address: str | None = None, evaluator: str | None = None, timeout: float | None = 5.0
    ) -> bool:
        for a in [address] if address else self.settings.addresses:
            if await self.health_status(address=a, evaluator=evaluator, timeout=timeout) == "SERVING":
                return True
        return False

    async def health_status(
        self, *, address: str | None = None, evaluator: str | None = None, timeout: float | None = 5.0
    ) -> str:
        stub = health_pb2_grpc.HealthStub(self._channel(address or self.settings.addresses[0]))
        try:
            resp = await stub.Check(
                health_pb2.HealthCheckRequest(service=health_service(evaluator)),
                timeout=timeout,
                metadata=self.settings.metadata,
            )
        except grpc.RpcError as e:
            return "SERVICE_UNKNOWN" if e.code() == grpc.StatusCode.NOT_FOUND else "UNREACHABLE"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
