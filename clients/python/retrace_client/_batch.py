"""evaluate_many's bookkeeping, shared by the sync and async clients.

EvaluateStream answers out of order, matched by request id, so every item goes out under an id
that is unique in the batch: the caller's own ids when they already are, else "#<index>" (the
caller's id is put back on the result). An item is answered by a Verdict or by the RetraceError
its response's `error` field describes; items whose error is retryable, or that were cut off
by a retryable failure of the whole stream, go out again on the next round.
"""

from __future__ import annotations

import dataclasses
import logging

from .errors import DeadlineExceeded, Internal, RetraceError, from_status_number
from .models import Verdict

log = logging.getLogger("retrace_client")


class Batch:
    def __init__(self, requests: list):
        self.requests = requests
        self.user_ids = [r.id for r in requests]
        if not (all(self.user_ids) and len(set(self.user_ids)) == len(self.user_ids)):
            for i, r in enumerate(requests):
                r.id = f"#{i}"
        self._index = {r.id: i for i, r in enumerate(requests)}
        self.results: list[Verdict | RetraceError | None] = [None] * len(requests)
        self.pending = list(range(len(requests)))
        self._answered: set[int] = set()

    def start_round(self, attempts) -> bool:
        """Whether another round may start: not once the deadline of `attempts` passed, which
        fails every pending item with DEADLINE_EXCEEDED."""
        if attempts.expired():
            self.fail_pending(DeadlineExceeded("the call's deadline passed", address=attempts.address))
            return False
        return True

    def on_response(self, response, address: str | None = None) -> None:
        i = self._index.get(response.id)
        if i is None:
            log.warning("retrace: a stream response carries an id no request had: %r", response.id)
            return
        self._answered.add(i)
        if response.HasField("error"):
            self.results[i] = from_status_number(response.error.code, response.error.message, address)
        else:
            verdict = Verdict.from_pb(response)
            self.results[i] = dataclasses.replace(verdict, id=self.user_ids[i])

    def end_round(self, stream_error: RetraceError | None) -> bool:
        """Settles this round's unanswered items and picks the next round's; True if any."""
        for i in self.pending:
            if i not in self._answered:
                self.results[i] = stream_error or Internal("the stream ended without answering this item")
        self.pending = [i for i in self.pending
                        if isinstance(self.results[i], RetraceError) and self.results[i].retryable]
        self._answered = set()
        return bool(self.pending)

    def fail_pending(self, error: RetraceError) -> None:
        for i in self.pending:
            if self.results[i] is None:
                self.results[i] = error
        self.pending = []
