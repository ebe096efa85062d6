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

from . import _core
from ._batch import Batch
from ._core import UNSET as _UNSET
from ._core import Core, Unary
from .errors import RetraceError, from_rpc_error
from .models import EvaluatorInfo, Ranking, Verdict


class AsyncClient(Core):
    """See Client for the arguments; every call is a coroutine."""

    _grpc = grpc.aio

    async def close(self) -> None:
        for ch in self._take_channels():
            await ch.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _unary(self, op: Unary, timeout):
        tries = self._attempts(timeout)
        while True:
            address = tries.begin()
            try:
                return op.parse(await self._invoke(op, address, tries.remaining()))
            except grpc.RpcError as e:
                err = from_rpc_error(e, address)
            delay = tries.retry_delay(err)
            if delay is None:
                raise err
            await asyncio.sleep(delay)

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
        return await self._unary(op, timeout)

    async def evaluate_many(
        self, items: Iterable[Any], *, max_in_flight: int = 64, timeout: float | None = _UNSET
    ) -> list[Verdict | RetraceError]:
        """As Client.evaluate_many: one stream, bounded in flight, results in input order."""
        batch = self._batch(items, max_in_flight)
        if not batch.requests:
            return []
        tries = self._attempts(timeout)
        while batch.start_round(tries):
            err = await self._stream_round(tries.address, batch, tries.remaining(), max_in_flight)
            # A failed stream may carry the server's pushback; an item's own error (a message
            # field, not a call's status) never does.
            retry_after = err.retry_after if err is not None else None
            delay = tries.retry_delay(retry_after=retry_after) if batch.end_round(err) else None
            if delay is None:
                break
            await asyncio.sleep(delay)
        return batch.results

    async def _stream_round(self, address, batch: Batch, timeout, max_in_flight) -> RetraceError | None:
        window = asyncio.Semaphore(max_in_flight)

        async def requests():
            for i in batch.pending:
                await window.acquire()
                yield batch.requests[i]

        call = self._open_stream(address, requests(), timeout)
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
        op = self._rank(
            question,
            candidates,
            options=options,
            reference_answer=reference_answer,
            evaluator=evaluator,
            threshold=threshold,
            id=id,
        )
        return await self._unary(op, timeout)

    async def list_evaluators(self, *, timeout: float | None = _UNSET) -> list[EvaluatorInfo]:
        return await self._unary(self._list_evaluators(), timeout)

    async def health(
        self, *, address: str | None = None, evaluator: str | None = None, timeout: float | None = 5.0
    ) -> bool:
        for a in self._health_addresses(address):
            if await self.health_status(address=a, evaluator=evaluator, timeout=timeout) == "SERVING":
                return True
        return False

    async def health_status(
        self, *, address: str | None = None, evaluator: str | None = None, timeout: float | None = 5.0
    ) -> str:
        try:
            resp = await self._health_check(address, evaluator, timeout)
        except grpc.RpcError as e:
            return _core.health_failure(e)
        return _core.health_name(resp)
