"""Retry hints for refusals that wait for a slot, from the requests actually holding the slots.

A refusal by ``tenant-concurrency``, ``backend-slots`` or ``inflight-tokens`` (and the wait
queue's ``queued`` / ``queue-full``) ends when a running request ends. The core's own hint for
these (its hold-time average ÷ slots in use) says a few milliseconds while the slots are held by
multi-second streams, so a client that retries when told to (the official ``openai`` client:
``retry-after-ms`` first, two retries by default) spends its retries in a moment and fails.

:class:`RunningRequests` keeps what this worker has admitted — start time, backend, tenant and
reserved completion tokens — and what finished requests taught about each backend (decode time
per output token, time to the first byte, recent hold times). Only a refusal computes a hint:
admission adds one entry to a set and settlement removes it (no hint work on the fast path),
and a hint is reused for :data:`HINT_REUSE` for the same scope, so a storm of refusals costs
one computation per scope every few milliseconds.

The rule (docs/admission.md states it): for each request holding a slot in the refusal's scope (the
tenant's own requests for ``tenant-concurrency``, the backend's for the others), its expected
remaining time is

1. its reserved completion tokens at the backend's observed decode rate: time to first byte +
   reserved completion × seconds per output token, minus the time it has already run;
2. when that is unknown (nothing finished yet with a usable token count, or no completion
   reserved) or already passed: the median of the backend's recent hold times longer than its
   elapsed time, minus that elapsed time (the hold-time distribution given elapsed);
3. when neither applies: overdue or unknown — a tenth of the time it has run (at least
   :data:`MIN_HINT`); with no history at all, as long again as it has run, and at least the
   rest of :data:`COLD_HOLD`.

The hint is the ``k``-th smallest of those (``k`` = requests queued ahead + 1): the next
release for a refusal, the release that reaches this request for the queue's refusals; past the
number of running requests, each further round adds a typical hold time. It is at least
:data:`MIN_HINT` and at most :data:`MAX_HINT`.

With ``serve --workers N`` each worker sees only the requests it admitted itself, so the hint is
based on this worker's running requests in the scope (and its own queue); when it holds none
there (the slots are held through other workers), :meth:`RunningRequests.hint` returns ``None``
and the caller keeps the core's hint.
"""

from __future__ import annotations

import time
from bisect import bisect_right
from collections import deque
from dataclasses import replace
from typing import Any

from kvgate.admission.refusal import Refusal
from kvgate.store import StoreRefusal

__all__ = [
    "COLD_HOLD",
    "MAX_HINT",
    "MIN_HINT",
    "SLOT_REASONS",
    "RunningRequests",
    "queue_retry",
    "slot_hint",
]

#: Refusal reasons that end when a running request ends (their hint comes from here).
SLOT_REASONS = frozenset(
    {"tenant-concurrency", "backend-slots", "inflight-tokens", "queued", "queue-full"}
)
#: Shortest hint (seconds): a slot is not released sooner than one decode step or so.
MIN_HINT = 0.05
#: Longest hint (seconds): a client asks again by then and gets a fresh estimate (the official
#: ``openai`` client ignores a ``Retry-After`` over 120 s and does not retry at all).
MAX_HINT = 60.0
#: Hold time (seconds) assumed before any request on the backend finished.
COLD_HOLD = 1.0
#: Hold times kept per backend for the distribution.
HOLD_SAMPLES = 64
#: Weight of a new sample in the per-token and first-byte averages.
EWMA_WEIGHT = 0.2
#: A hint is reused for this long (seconds) for the same scope and queue position, so a burst
#: of refusals costs one computation per scope every few milliseconds, not one each.
HINT_REUSE = 0.005


class _Running:
    """One admitted request: ``backend`` / ``tenant`` ids, reserved ``completion`` tokens,
    ``started`` (``time.monotonic()`` seconds)."""

    __slots__ = ("backend", "completion", "started", "tenant")

    def __init__(self, backend: int, tenant: int, completion: int, started: float) -> None:
        self.backend = backend
        self.tenant = tenant
        self.completion = completion
        self.started = started


class _BackendStats:
    """What finished requests taught about one backend."""

    __slots__ = ("first_byte", "holds", "per_token")

    def __init__(self) -> None:
        #: seconds per output token (EWMA), ``None`` until measured
        self.per_token: float | None = None
        #: seconds to the response head of a stream (EWMA)
        self.first_byte = 0.0
        #: recent hold times (seconds)
        self.holds: deque[float] = deque(maxlen=HOLD_SAMPLES)


class RunningRequests:
    """The requests this worker has admitted and not yet settled, and the timing they taught.

    Use :meth:`start` when a request is admitted, :meth:`finish` when it is settled (always,
    also on errors and disconnects), :meth:`hint` when a request is refused for a slot.
    """

    __slots__ = ("_recent", "_running", "_stats")

    def __init__(self) -> None:
        self._running: set[_Running] = set()
        self._stats: dict[int, _BackendStats] = {}
        #: (backend, tenant, ahead) → (when computed, hint): see :data:`HINT_REUSE`
        self._recent: dict[tuple[int, int | None, int], tuple[float, float | None]] = {}

    def __len__(self) -> int:
        return len(self._running)

    def count(self, tenant: int, started_before: float) -> int:
        """How many of ``tenant``'s requests that started before ``started_before``
        (``time.monotonic()`` seconds) still run here (a scan of the running requests)."""
        return sum(1 for r in self._running if r.tenant == tenant and r.started < started_before)

    def start(self, backend: int, tenant: int, completion_tokens: int) -> _Running:
        """Record an admitted request on ``backend`` for ``tenant`` that reserved
        ``completion_tokens`` (0 when it generates nothing, e.g. embeddings); returns the entry
        to pass to :meth:`finish`."""
        entry = _Running(backend, tenant, completion_tokens, time.monotonic())
        self._running.add(entry)
        return entry

    def finish(
        self,
        entry: _Running,
        *,
        completed: bool,
        stream: bool,
        first_byte: float | None,
        completion_tokens: int,
    ) -> None:
        """Forget ``entry`` and, when the request ``completed`` normally, learn from it: its hold
        time, and its seconds per output token (a stream: (hold − ``first_byte``) ÷ tokens; a
        whole answer: hold ÷ tokens) when it generated ``completion_tokens`` ≥ 1.

        Args:
            entry: from :meth:`start`.
            completed: the engine answered in full (no disconnect, error or timeout: a cut-off
                hold says nothing about how long requests run).
            stream: the answer was streamed (``first_byte`` is then the time to its head).
            first_byte: seconds from sending to the engine's response head, or ``None``.
            completion_tokens: output tokens the engine generated.
        """
        self._running.discard(entry)
        if not completed:
            return
        hold = time.monotonic() - entry.started
        stats = self._stats.get(entry.backend)
        if stats is None:
            stats = self._stats[entry.backend] = _BackendStats()
        stats.holds.append(hold)
        if completion_tokens < 1:
            return
        head = first_byte if (stream and first_byte is not None and first_byte < hold) else 0.0
        per_token = (hold - head) / completion_tokens
        if stats.per_token is None:
            stats.per_token, stats.first_byte = per_token, head
        else:
            stats.per_token += EWMA_WEIGHT * (per_token - stats.per_token)
            stats.first_byte += EWMA_WEIGHT * (head - stats.first_byte)

    def hint(self, backend: int, tenant: int | None = None, ahead: int = 0) -> float | None:
        """Seconds until a slot is expected to reach a request refused now (the module's rule).

        Args:
            backend: the backend id of the refusal.
            tenant: a tenant id for a ``tenant-concurrency`` refusal (only that tenant's running
                requests count, on any backend); ``None``: the backend's running requests.
            ahead: requests queued ahead of this one (each takes a release first).

        Returns:
            The hint in seconds (:data:`MIN_HINT` .. :data:`MAX_HINT`), or ``None`` when this
            worker holds no request in that scope (the slots are held through other workers).
        """
        now = time.monotonic()
        key = (backend, tenant, max(0, ahead))
        recent = self._recent.get(key)
        if recent is not None and now - recent[0] < HINT_REUSE:
            return recent[1]
        if len(self._recent) > 1024:  # a bounded memo, not a store
            self._recent.clear()
        if tenant is None:
            mine = [e for e in self._running if e.backend == backend]
        else:
            mine = [e for e in self._running if e.tenant == tenant]
        hint = None
        if mine:
            holds: dict[int, list[float]] = {}  # each backend's recent holds, sorted once
            remaining = sorted(self._remaining(e, now - e.started, holds) for e in mine)
            rounds, k = divmod(key[2], len(remaining))
            wait = remaining[k]
            if rounds:
                wait += rounds * self._typical_hold(backend, remaining)
            hint = min(MAX_HINT, max(MIN_HINT, wait))
        self._recent[key] = (now, hint)
        return hint

    def _remaining(self, entry: _Running, elapsed: float, holds: dict[int, list[float]]) -> float:
        """Expected seconds until ``entry`` (running for ``elapsed`` seconds) ends; ``holds``
        caches each backend's sorted recent hold times for one :meth:`hint`."""
        stats = self._stats.get(entry.backend)
        if stats is None:  # nothing finished on this backend yet
            return max(COLD_HOLD - elapsed, elapsed, MIN_HINT)
        if stats.per_token is not None and entry.completion > 0:
            left = stats.first_byte + entry.completion * stats.per_token - elapsed
            if left > 0:
                return left
        ordered = holds.get(entry.backend)
        if ordered is None:
            ordered = holds[entry.backend] = sorted(stats.holds)
        first_longer = bisect_right(ordered, elapsed)
        if first_longer < len(ordered):  # the median of the holds longer than elapsed
            return ordered[(first_longer + len(ordered)) // 2] - elapsed
        return max(elapsed / 10, MIN_HINT)  # overdue: it may end any moment, but not at once

    def _typical_hold(self, backend: int, remaining: list[float]) -> float:
        """A whole hold time on ``backend``: the median of its recent holds, else the longest
        expected remaining time of those running."""
        stats = self._stats.get(backend)
        if stats is not None and stats.holds:
            holds = sorted(stats.holds)
            return holds[len(holds) // 2]
        return max(remaining[-1], COLD_HOLD)


def queue_retry(controller: Any, backend_id: int, queued: int) -> float:
    """Seconds until a request refused by the wait queue (``queued``, ``queue-full``) may get
    a turn when this worker runs no request on the backend (else :func:`slot_hint` decides):
    the backend's expected time to the next slot release (its hold-time average ÷ slots in use,
    a 1 s hold when nothing finished yet — the core's own rule) for each of the ``queued``
    requests ahead, plus one. Also kvgate's own hint for a request the engine refused with 429
    or 503 (the relay sends the longer of it and the engine's).

    Args:
        controller: the admission core (its ``backend_state``: ``hold_time_ewma`` seconds,
            ``in_use`` slots).
        queued: requests waiting in this worker's queue.
    """
    st = controller.backend_state(backend_id)
    hold = st["hold_time_ewma"] or 1.0
    per_slot = hold / max(1, st["in_use"])
    return max(0.001, per_slot * (queued + 1))


def slot_hint(
    decision: Any, running: RunningRequests, backend_id: int, tenant_id: int, queued: int
) -> Any:
    """``decision`` with its retry hint computed from the requests holding the slots
    (:class:`RunningRequests`), when it is a refusal that waits for a slot: for
    ``tenant-concurrency`` the tenant's own running requests, for ``backend-slots`` /
    ``inflight-tokens`` the backend's, for ``queued`` / ``queue-full`` the backend's with the
    ``queued`` requests of this worker's queue counted ahead. Otherwise, or when this worker
    runs no request in that scope (with ``--workers N`` the slots may be held through other
    workers), ``decision`` as it is (the core's hint). A refusal of the store keeps what it
    says of the limit across the replicas (``remaining``, ``reset_after``) and its ``note``.
    Runs on refusals only."""
    reason = decision.reason
    if reason not in SLOT_REASONS or decision.never:
        return decision
    if reason == "tenant-concurrency":
        hint = running.hint(backend_id, tenant=tenant_id)
    elif reason in ("queued", "queue-full"):
        hint = running.hint(backend_id, ahead=queued)
    else:
        hint = running.hint(backend_id)
    if hint is None:
        return decision
    if isinstance(decision, (Refusal, StoreRefusal)):  # the store's figures and note stay
        return replace(decision, retry_after=hint)
    return Refusal(reason, scope=decision.scope, retry_after=hint)
