"""retrace-client: Python client for the retrace step-level reasoning judge.

`Client` (sync) and `AsyncClient` (asyncio) speak gRPC to `retrace serve`; `retrace_client.trl`
and `retrace_client.verl` turn them into trainers' reward functions, and `retrace_client.areal`
into an AReaL process-reward scorer. Results are the frozen dataclasses in `models`; failures
are `RetraceError` subclasses from `errors`.
"""

from ._proto import pb
from .aio import AsyncClient
from .client import Client
from .errors import (
    Cancelled,
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    RetraceError,
    Unauthenticated,
    Unavailable,
)
from .models import EvaluatorInfo, RankedCandidate, Ranking, StepVerdict, Timing, Trace, Verdict
from .rewards import reward

__all__ = [
    "AsyncClient",
    "Cancelled",
    "Client",
    "DeadlineExceeded",
    "EvaluatorInfo",
    "Internal",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "RankedCandidate",
    "Ranking",
    "ResourceExhausted",
    "RetraceError",
    "StepVerdict",
    "Timing",
    "Trace",
    "Unauthenticated",
    "Unavailable",
    "Verdict",
    "pb",
    "reward",
]
