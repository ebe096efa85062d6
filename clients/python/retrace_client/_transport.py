"""What the sync and async clients share: addresses, credentials, metadata, channel options, the
retry policy.

A call starts at the next address in round-robin order, and each retry moves one address on,
so a dead replica costs one fast UNAVAILABLE, not the call. Only UNAVAILABLE and
RESOURCE_EXHAUSTED are retried; everything else, INVALID_ARGUMENT above all, fails at once. A
retry waits the server's pushback when the failure carried one (`grpc-retry-pushback-ms`, the
server's estimate of when the work ahead drains), else a full-jitter exponential backoff. The
call's timeout is one deadline over all its attempts, so retries never stretch a call past what
the caller allowed: a wait that would end past it means no retry.
"""

from __future__ import annotations

import itertools
import os
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import grpc

from .errors import DeadlineExceeded

DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_TIMEOUT_S = 30.0

# Messages of a Rank over many long candidates outgrow grpc's 4 MiB default.
_CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
)


# gRPC targets that carry an address list of their own: "ipv4:h1:p1,h2:p2", "ipv6:[a]:p1,[b]:p2".
_LIST_SCHEMES = ("ipv4:", "ipv6:")


def is_address_list(target: str) -> bool:
    """Whether `target` is one gRPC target naming several addresses (ipv4:/ipv6: with commas)."""
    return target.lower().startswith(_LIST_SCHEMES) and "," in target


def parse_addresses(addresses: str | Sequence[str] | None) -> list[str]:
    """A list, a comma-separated string, or None for $RETRACE_ADDRESS (else 127.0.0.1:50051).
    A string that is an ipv4:/ipv6: target stays whole: its commas are gRPC's own address list."""
    if addresses is None:
        addresses = os.environ.get("RETRACE_ADDRESS") or DEFAULT_ADDRESS
    if isinstance(addresses, str):
        addresses = [addresses] if addresses.strip().lower().startswith(_LIST_SCHEMES) else addresses.split(",")
    out = [a.strip() for a in addresses if a and a.strip()]
    if not out:
        raise ValueError("no retrace address given")
    return out


def channel_options(target: str, given: tuple) -> tuple:
    """The options of `target`'s channel: `given`, plus what a multi-address target needs.

    For an ipv4:/ipv6: list gRPC takes the whole list ("h1:p1,h2:p2") as the channel's default
    authority, which is no valid HTTP/2 :authority, so the server resets every stream
    (INTERNAL, "Stream removed"); the first address is the authority instead. And gRPC's default
    pick_first would send every call to the first address, so calls go round-robin over the
    list, as they do over the client's own addresses. Either is left alone when `given` sets it.
    """
    if not is_address_list(target):
        return given
    names = {name for name, _ in given}
    extra = []
    if "grpc.default_authority" not in names:
        first = target.split(":", 1)[1].split(",")[0].strip()
        extra.append(("grpc.default_authority", first))
    if not names & {"grpc.lb_policy_name", "grpc.service_config"}:
        extra.append(("grpc.lb_policy_name", "round_robin"))
    return given + tuple(extra)


def _read_pem(value: str | bytes | os.PathLike | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    return Path(value).read_bytes()


@dataclass
class Settings:
    """Everything a client is built from; see Client for the meaning of each field."""

    addresses: list[str]
    token: str | None
    tls: bool
    root_certificates: bytes | None
    timeout: float | None
    retries: int
    backoff_initial: float
    backoff_max: float
    evaluator: str
    channel_options: tuple

    @classmethod
    def build(
        cls,
        addresses=None,
        *,
        token=None,
        tls=False,
        root_certificates=None,
        timeout=DEFAULT_TIMEOUT_S,
        retries=3,
        backoff_initial=0.1,
        backoff_max=2.0,
        evaluator="",
        channel_options=(),
    ) -> "Settings":
        if retries < 0:
            raise ValueError("retries must be >= 0")
        if token is None:
            token = os.environ.get("RETRACE_TOKEN") or None
        return cls(
            addresses=parse_addresses(addresses),
            token=token,
            tls=bool(tls or root_certificates is not None),
            root_certificates=_read_pem(root_certificates),
            timeout=timeout,
            retries=int(retries),
            backoff_initial=float(backoff_initial),
            backoff_max=float(backoff_max),
            evaluator=evaluator or "",
            channel_options=_CHANNEL_OPTIONS + tuple(channel_options),
        )

    @property
    def metadata(self) -> tuple:
        if not self.token:
            return ()
        return (("authorization", f"Bearer {self.token}"),)

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.root_certificates)

    def backoff(self, attempt: int) -> float:
        """Full jitter: uniform in [0, min(max, initial * 2**attempt)]."""
        return random.uniform(0.0, min(self.backoff_max, self.backoff_initial * (2**attempt)))


class RoundRobin:
    """Hands out each call's first address index; retries step on from it."""

    def __init__(self, n: int):
        self._n = n
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def start(self) -> int:
        with self._lock:
            return next(self._counter) % self._n


class Deadline:
    """One call's deadline over all of its attempts; None means no deadline."""

    def __init__(self, timeout: float | None):
        self._at = None if timeout is None else time.monotonic() + float(timeout)

    def remaining(self) -> float | None:
        if self._at is None:
            return None
        return self._at - time.monotonic()

    def expired(self) -> bool:
        r = self.remaining()
        return r is not None and r <= 0

    def allows_sleep(self, seconds: float) -> bool:
        r = self.remaining()
        return r is None or r > seconds


class Attempts:
    """One call's attempts: the address each goes to, and whether another may follow it."""

    def __init__(self, settings: Settings, start: int, timeout: float | None):
        self._settings = settings
        self._start = start
        self._n = 0
        self._deadline = Deadline(timeout)

    @property
    def address(self) -> str:
        addresses = self._settings.addresses
        return addresses[(self._start + self._n) % len(addresses)]

    def begin(self) -> str:
        """This attempt's address; raises DeadlineExceeded when the deadline passed before it."""
        if self.expired():
            raise DeadlineExceeded("the call's deadline passed before an attempt could start", address=self.address)
        return self.address

    def expired(self) -> bool:
        return self._deadline.expired()

    def remaining(self) -> float | None:
        return self._deadline.remaining()

    def retry_delay(self, error=None, *, retry_after: float | None = None) -> float | None:
        """The wait before the next attempt, which goes one address on: the server's pushback
        (`retry_after` seconds, by default `error.retry_after`) when it gave one, else the
        jittered backoff. None when `error` (a RetraceError) is not retryable, the retries are
        spent, or the wait would not end before the deadline."""
        if error is not None and not error.retryable:
            return None
        if retry_after is None and error is not None:
            retry_after = error.retry_after
        if self._n >= self._settings.retries:
            return None
        # The server knows its queue; the jitter only guesses at it, so a pushback replaces it.
        delay = self._settings.backoff(self._n) if retry_after is None else float(retry_after)
        if not self._deadline.allows_sleep(delay):
            return None
        self._n += 1
        return delay
