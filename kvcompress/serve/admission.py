"""Admission control: how many generations the server holds at once, and when to come back.

A request takes one slot per choice it generates (prompts x ``n``) until its answer is sent or
its client leaves. The generation loop decodes up to ``--decode-concurrency`` of them at a time
and queues the rest (in arrival order); past ``--max-concurrent-requests`` slots a request is
refused at once with 503 and ``Retry-After`` -- never left to time out, and never a reset
connection. ``Retry-After`` estimates when enough slots free up, from the recent request
durations (the mean of the last 32) and the number of requests ahead.
"""

from __future__ import annotations

import collections
import math
import threading
import time

from .errors import Overloaded

__all__ = ["Admission", "Ticket"]


class Ticket:
    """The slots one request holds; :meth:`release` (idempotent) gives them back."""

    def __init__(self, admission: "Admission", n: int):
        self._admission, self.n = admission, n
        self._t0 = time.monotonic()
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission._release(self.n, time.monotonic() - self._t0)

    def __enter__(self) -> "Ticket":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class Admission:
    """At most ``capacity`` slots held; ``batch`` of them generate at a time."""

    def __init__(self, capacity: int, batch: int):
        if capacity < 1 or batch < 1:
            raise ValueError(f"capacity and batch must be >= 1, got {capacity}, {batch}")
        self.capacity, self.batch = capacity, batch
        self.held = 0
        self.refused = 0
        self._durations: collections.deque = collections.deque(maxlen=32)
        self._lock = threading.Lock()

    def admit(self, n: int = 1) -> Ticket:
        """``n`` slots, or :class:`~.errors.Overloaded` with a ``Retry-After`` estimate."""
        with self._lock:
            if self.held + n > self.capacity:
                self.refused += 1
                raise Overloaded(
                    f"the server is at capacity ({self.held} of {self.capacity} generations held; "
                    f"--max-concurrent-requests); retry after the Retry-After seconds",
                    code="server_at_capacity", retry_after=self._retry_after(n))
            self.held += n
        return Ticket(self, n)

    def _release(self, n: int, seconds: float) -> None:
        with self._lock:
            self.held -= n
            self._durations.append(seconds)

    def _retry_after(self, n: int) -> int:
        """Seconds until ``n`` slots are likely free: requests finish at about ``batch`` per mean
        duration, and ``held + n - capacity`` of them must finish first."""
        mean = sum(self._durations) / len(self._durations) if self._durations else 1.0
        waves = (self.held + n - self.capacity) / self.batch
        return int(min(60, max(1, math.ceil(mean * max(waves, 1 / self.batch)))))
