"""Events from the engine thread to the asyncio queues of their requests, one loop wake-up per burst.

`loop.call_soon_threadsafe` writes to the event loop's self-pipe on every call: with 8 slots that
is 8 system calls and 8 loop wake-ups per decode step. The relay collects the events the engine
posts while the loop has not run yet and hands them over in one callback, in the order posted.
"""
from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import Any


class EventRelay:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._items: deque[tuple[asyncio.Queue, Any]] = deque()
        self._lock = threading.Lock()
        self._scheduled = False
        self.wakeups = 0  # loop callbacks scheduled (events / wakeups = events per wake-up)

    def post(self, queue: asyncio.Queue, event: Any) -> None:
        """From any thread: deliver `event` into `queue` on the loop."""
        with self._lock:
            self._items.append((queue, event))
            if self._scheduled:
                return
            self._scheduled = True
            self.wakeups += 1
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, deque()
            self._scheduled = False
        for queue, event in items:
            queue.put_nowait(event)
