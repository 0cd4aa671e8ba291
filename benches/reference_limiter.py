"""Pure-Python reference limiter: what the article's Go sketch does, for side-by-side benches.

One ``threading.Lock`` guards a slot counter and a float token bucket refilled from
``time.monotonic()`` on every call (the Go sketch's ``sync.Mutex`` + ``float64`` tokens).
Like the sketch it refunds unused tokens; unlike it, an overrun is charged too, so the work per
call matches the Rust path. Not used by kvgate itself.
"""

from __future__ import annotations

import threading
import time


class RefSlotPool:
    """Concurrency slots behind a lock."""

    def __init__(self, limit: int) -> None:
        self._lock = threading.Lock()
        self.limit = limit
        self.in_use = 0

    def try_acquire(self, n: int = 1) -> bool:
        with self._lock:
            if self.in_use + n > self.limit:
                return False
            self.in_use += n
            return True

    def release(self, n: int = 1) -> None:
        with self._lock:
            if n > self.in_use:
                raise ValueError("over-release")
            self.in_use -= n


class RefTokenBucket:
    """A float token bucket (tokens per minute) behind a lock."""

    def __init__(self, tokens_per_minute: float, burst: float | None = None) -> None:
        self._lock = threading.Lock()
        self.rate = tokens_per_minute / 60.0
        self.burst = float(burst if burst is not None else tokens_per_minute)
        self.tokens = self.burst
        self.last = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now

    def try_reserve(self, n: int) -> bool:
        with self._lock:
            self._refill()
            if self.tokens < n:
                return False
            self.tokens -= n
            return True

    def reconcile(self, reserved: int, actual: int) -> None:
        with self._lock:
            self._refill()
            self.tokens = max(-self.burst, min(self.burst, self.tokens + reserved - actual))


class RefJointLimiter:
    """The Go sketch's joint limiter: slots + TPM under one lock; ``acquire`` returns a release
    callback or ``None``."""

    def __init__(self, max_concurrency: int, tokens_per_minute: float) -> None:
        self._lock = threading.Lock()
        self.limit = max_concurrency
        self.in_use = 0
        self.rate = tokens_per_minute / 60.0
        self.burst = float(tokens_per_minute)
        self.tokens = self.burst
        self.last = time.monotonic()

    def acquire(self, tokens: int) -> bool:
        with self._lock:
            if self.in_use >= self.limit:
                return False
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
            self.last = now
            if self.tokens < tokens:
                return False
            self.tokens -= tokens
            self.in_use += 1
            return True

    def release(self, reserved: int, actual: int) -> None:
        with self._lock:
            self.in_use -= 1
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
            self.last = now
            self.tokens = max(-self.burst, min(self.burst, self.tokens + reserved - actual))
