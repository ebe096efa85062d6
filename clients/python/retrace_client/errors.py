"""The client's exceptions: one RetraceError subclass per gRPC status the server returns.

Each carries the status code's name (`code`, e.g. "INVALID_ARGUMENT") and the server's message,
which names the field at fault (`trace.steps[1]: is empty`). A failed item of evaluate_many is
one of these as a value, built from the stream response's `error` field.
"""

from __future__ import annotations

import grpc


class RetraceError(Exception):
    """A call to retrace failed. `code` is the gRPC status name, `message` the server's text."""

    code = "UNKNOWN"

    def __init__(self, message: str, *, code: str | None = None, address: str | None = None):
        if code is not None:
            self.code = code
        self.message = message
        self.address = address
        super().__init__(f"{self.code}: {message}")

    def __reduce__(self):
        # Keeps code, message and address across pickling (a verl reward worker is a process).
        return (from_code, (self.code, self.message, self.address))

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


def from_code(code: str, message: str, address: str | None = None) -> RetraceError:
    """The exception for a status name; codes without a class of their own get RetraceError."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return RetraceError(message, code=code, address=address)
    return cls(message, address=address)


def from_rpc_error(error: grpc.RpcError, address: str | None = None) -> RetraceError:
    """Converts a grpc (sync or aio) failure into the matching RetraceError."""
    status = error.code() if hasattr(error, "code") else None
    name = status.name if isinstance(status, grpc.StatusCode) else "UNKNOWN"
    details = error.details() if hasattr(error, "details") else None
    return from_code(name, details or str(error), address)


def from_status_number(number: int, message: str, address: str | None = None) -> RetraceError:
    """Converts a stream item's `Error` (a numeric gRPC code) into a RetraceError."""
    return from_code(_NAME_BY_NUMBER.get(number, "UNKNOWN"), message, address)
