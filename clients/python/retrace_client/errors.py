"""The client's exceptions: one RetraceError subclass per gRPC status the server returns.

Each carries the status code's name (`code`, e.g. "INVALID_ARGUMENT") and the server's message,
which names the field at fault (`trace.steps[1]: is empty`). A failed item of evaluate_many is
one of these as a value, built from the stream response's `error` field.

An overloaded server can say when to come back: gRPC's retry pushback, trailing metadata
`grpc-retry-pushback-ms` holding a decimal count of milliseconds. An error built from a failed
call keeps it as `retry_after` (seconds), which the retry policy (_transport.py) waits instead of
its own backoff.
"""

from __future__ import annotations

import re

import grpc

PUSHBACK_KEY = "grpc-retry-pushback-ms"
# gRPC's retry design sends the pushback as a signed 32-bit count of milliseconds: only digits, and
# no more of them than that range holds.
_PUSHBACK_VALUE = re.compile(r"[0-9]{1,10}")
_PUSHBACK_MAX_MS = 2**31 - 1


class RetraceError(Exception):
    """A call to retrace failed. `code` is the gRPC status name, `message` the server's text,
    `retry_after` the seconds the server asked the client to wait before a retry (None when it
    did not say)."""

    code = "UNKNOWN"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        address: str | None = None,
        retry_after: float | None = None,
    ):
        if code is not None:
            self.code = code
        self.message = message
        self.address = address
        self.retry_after = retry_after
        super().__init__(f"{self.code}: {message}")

    def __reduce__(self):
        # Keeps code, message, address and pushback across pickling (a verl reward worker is a process).
        return (from_code, (self.code, self.message, self.address, self.retry_after))

    @property
    def retryable(self) -> bool:
        """Whether a retry may succeed: only overload and unavailability are retried."""
        return self.code in RETRYABLE


class InvalidArgument(RetraceError):
    code = "INVALID_ARGUMENT"


class Unauthenticated(RetraceError):
    code = "UNAUTHENTICATED"


class PermissionDenied(RetraceError):
    code = "PERMISSION_DENIED"


class NotFound(RetraceError):
    code = "NOT_FOUND"


class ResourceExhausted(RetraceError):
    code = "RESOURCE_EXHAUSTED"


class Unavailable(RetraceError):
    code = "UNAVAILABLE"


class DeadlineExceeded(RetraceError):
    code = "DEADLINE_EXCEEDED"


class Cancelled(RetraceError):
    code = "CANCELLED"


class Internal(RetraceError):
    code = "INTERNAL"


RETRYABLE = frozenset({"UNAVAILABLE", "RESOURCE_EXHAUSTED"})

_BY_CODE = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        Unauthenticated,
        PermissionDenied,
        NotFound,
        ResourceExhausted,
        Unavailable,
        DeadlineExceeded,
        Cancelled,
        Internal,
    )
}
_NAME_BY_NUMBER = {c.value[0]: c.name for c in grpc.StatusCode}


def from_code(
    code: str, message: str, address: str | None = None, retry_after: float | None = None
) -> RetraceError:
    """The exception for a status name; codes without a class of their own get RetraceError."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return RetraceError(message, code=code, address=address, retry_after=retry_after)
    return cls(message, address=address, retry_after=retry_after)


def retry_pushback(metadata) -> float | None:
    """The server's retry pushback in seconds, from a call's trailing metadata ((key, value)
    pairs, as sync and aio grpc both iterate it); None when there is none or it is not a
    non-negative integer of milliseconds within gRPC's 32-bit range.

    gRPC's own retry design reads an unparseable or negative pushback as "do not retry"; here it
    counts as no pushback and the usual backoff applies, so a garbled header from a proxy
    costs a retry's wait, never the retry itself."""
    for key, value in metadata or ():
        if key.lower() != PUSHBACK_KEY:
            continue
        if isinstance(value, bytes):
            value = value.decode("ascii", errors="replace")
        value = str(value).strip()
        if _PUSHBACK_VALUE.fullmatch(value) and int(value) <= _PUSHBACK_MAX_MS:
            return int(value) / 1000.0
        return None
    return None


def _trailing_metadata(error: grpc.RpcError):
    # A failure grpc raised before the call started (or a stand-in RpcError) may have no
    # trailing metadata to read; that is no pushback, not a second failure.
    try:
        return error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    except Exception:
        return None


def from_rpc_error(error: grpc.RpcError, address: str | None = None) -> RetraceError:
    """Converts a grpc (sync or aio) failure into the matching RetraceError, with the call's
    retry pushback (if any) as `retry_after`."""
    status = error.code() if hasattr(error, "code") else None
    name = status.name if isinstance(status, grpc.StatusCode) else "UNKNOWN"
    details = error.details() if hasattr(error, "details") else None
    return from_code(name, details or str(error), address, retry_pushback(_trailing_metadata(error)))


def from_status_number(number: int, message: str, address: str | None = None) -> RetraceError:
    """Converts a stream item's `Error` (a numeric gRPC code) into a RetraceError."""
    return from_code(_NAME_BY_NUMBER.get(number, "UNKNOWN"), message, address)
