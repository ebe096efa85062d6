"""One AsyncClient per event loop, for adapters whose caller picks the loop.

grpc.aio channels are tied to the loop that first used them; TRL runs async reward functions
on its own daemon loop, verl on its reward workers' loops, a test on asyncio.run's fresh loop.
Keying the client by the running loop makes one adapter object safe in all of them.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Callable

from .aio import AsyncClient


class PerLoop:
    def __init__(self, factory: Callable[[], AsyncClient]):
        self._factory = factory
        self._clients: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncClient]" = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def get(self) -> AsyncClient:
        loop = asyncio.get_running_loop()
        with self._lock:
            client = self._clients.get(loop)
            if client is None or loop.is_closed():
                client = self._factory()
                self._clients[loop] = client
            return client

    def pop(self) -> AsyncClient | None:
        """Forgets the running loop's client and returns it (None when it has none), to close it."""
        loop = asyncio.get_running_loop()
        with self._lock:
            return self._clients.pop(loop, None)
