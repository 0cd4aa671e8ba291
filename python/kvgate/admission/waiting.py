"""Waiting for admission: what a request the admission core refused does next (no HTTP here).

A refusal stands as the answer at once (no await) when waiting cannot change it: no wait queue,
no wait allowed for the tenant or asked by the client, a request that can never fit, or a shed
class. Otherwise the request waits in the priority wait queue
(:class:`kvgate.admission.wait_queue.PriorityWaitQueue`: critical before standard before
sheddable, fair between tenants, bounded) until the core admits it or its wait time is up. The
head waiter tries again when a request of this process ends or a limit grows; when a token
bucket refused it, once the bucket has refilled; and, with a core shared by worker processes,
after the core's retry hint (at least 50 ms), since a slot another worker frees is announced
only to that worker's queue.
In shadow mode (:mod:`kvgate.admission.shadow`) it never waits: a refusal is only counted.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from kvgate.admission.refusal import Refusal
from kvgate.admission.retry_hint import MIN_HINT, queue_retry
from kvgate.admission.shadow import SHADOW_ADMISSION, in_shadow

if TYPE_CHECKING:
    from kvgate.app import Backend, Gateway, Tenant

__all__ = [
    "MAX_WAIT_HEADER",
    "allowed_wait",
    "max_wait",
    "queue_hint",
    "refusal_stands",
    "wait_for_admission",
]

#: the request header that shortens (never lengthens) the tenant's wait, in milliseconds
MAX_WAIT_HEADER = "x-kvgate-max-wait-ms"
#: refusals that time alone lifts (a token bucket refilling), not a release
_REFILL_REASONS = frozenset({"tenant-tpm", "backend-tpm"})


class _NeverFits(Exception):
    """Raised from a queued ``try_admit`` whose request can never be admitted."""

    def __init__(self, rejection: Any) -> None:
        super().__init__(rejection.reason)
        self.rejection = rejection


#: the refusal of a waiting request whose tenant a reload removed (429 without a retry hint:
#: its API key no longer works)
REMOVED = Refusal("tenant-concurrency", scope="tenant", retry_after=None, never=True)


def max_wait(tenant: Tenant, asked_ms: str | None) -> float:
    """Seconds a refused request may wait: the tenant's ``max_wait_ms``, shortened (never
    lengthened) by the client's :data:`MAX_WAIT_HEADER` value ``asked_ms`` (milliseconds,
    fractions allowed; a value that is not a finite number is ignored; ``None``: not sent)."""
    wait_ms = float(tenant.max_wait_ms)
    if wait_ms <= 0:  # the header can only shorten it
        return 0.0
    if asked_ms is not None:
        with contextlib.suppress(ValueError):
            value = float(asked_ms)  # milliseconds, fractions allowed ("1500.5")
            if math.isfinite(value):
                wait_ms = min(wait_ms, max(0.0, value))
    return wait_ms / 1000.0


def allowed_wait(tenant: Tenant, headers: Mapping[str, str] | None) -> float:
    """:func:`max_wait` with the client's :data:`MAX_WAIT_HEADER` read from the request's
    ``headers`` (``None``: none sent), only when the tenant may wait at all (seconds)."""
    if headers is None or tenant.max_wait_ms <= 0:
        return max_wait(tenant, None)
    return max_wait(tenant, headers.get(MAX_WAIT_HEADER))


def queue_hint(gw: Gateway, backend_id: int) -> float:
    """kvgate's own wait hint (seconds) on ``backend_id`` for a request refused by the wait
    queue, the prefill budget or the latency targets, or by the engine with 429 or 503
    (:func:`kvgate.admission.retry_hint.queue_retry` with this worker's queued requests)."""
    queue = gw.queue
    return queue_retry(gw.controller, backend_id, queue.waiting if queue is not None else 0)


def refusal_stands(
    gw: Gateway,
    backend: Backend,
    tenant: Tenant,
    refusal: Any,
    headers: Mapping[str, str] | None,
) -> bool:
    """Whether the core's refusal on the fast path is the answer as it is (decided without an
    await): not in shadow mode, and waiting could not change it. Otherwise
    :func:`wait_for_admission` decides."""
    return not in_shadow(gw.config, backend, tenant) and _waiting_cannot_help(
        gw, tenant, refusal, headers
    )


def _waiting_cannot_help(
    gw: Gateway, tenant: Tenant, refusal: Any, headers: Mapping[str, str] | None
) -> bool:
    """No wait queue, no wait allowed, never admissible, or a shed class (the cheapest checks
    first: this runs on every refusal)."""
    return (
        gw.queue is None
        or tenant.max_wait_ms <= 0
        or refusal.never
        or refusal.reason == "shed"
        or allowed_wait(tenant, headers) <= 0
    )


async def wait_for_admission(
    gw: Gateway,
    backend: Backend,
    tenant: Tenant,
    priority: str,
    tokens: int,
    refusal: Any,
    gate: Callable[[], Any] | None = None,
    headers: Mapping[str, str] | None = None,
) -> Any:
    """Admission when the core's fast path did not admit: shadow mode, then the priority wait
    queue.

    Args:
        tokens: prompt + reserved completion (tokens).
        refusal: the core's ``Rejection`` from the fast path, or ``None`` when the fast path
            was skipped because requests are queued.
        gate: checks after the core admitted (the prefill budget, latency targets; no await):
            ``None`` to go on, or a refusal (the core's reservation is then given back and the
            request waits again).
        headers: the request's headers (its :data:`MAX_WAIT_HEADER`), or ``None``.

    Returns:
        A ``Reservation``, the shadow admission, or a refusal (``Rejection`` / :class:`Refusal`)
        whose ``reason`` names what refused it.
    """
    from kvgate.admission.wait_queue import QueueFull, Shed, WaitTimeout

    controller = gw.controller
    if refusal is None:
        # the fast path was skipped because others are queued: what can never fit, and a shed
        # class, must still be answered at once, not parked behind them
        refusal = _refuse_without_queueing(controller, backend, tenant, priority, tokens)
    if in_shadow(gw.config, backend, tenant):
        # a shadow request never waits, not even behind queued ones: the core decides now, and
        # a refusal is only counted
        if refusal is None:
            decision = controller.admit(backend.id, tenant.id, priority, tokens)
            if decision.admitted:
                return decision
            refusal = decision
        gw.metrics.shadow_rejections.labels(refusal.reason).inc()
        return SHADOW_ADMISSION
    queue = gw.queue
    if refusal is None and queue is None:  # no queue configured: decide now
        decision = controller.admit(backend.id, tenant.id, priority, tokens)
        if decision.admitted and gate is not None:
            extra = gate()
            if extra is not None:
                decision.release(0)
                return extra
        return decision
    if refusal is not None and _waiting_cannot_help(gw, tenant, refusal, headers):
        return refusal
    assert queue is not None  # _waiting_cannot_help is true without a queue
    last: list[Any] = [refusal]
    # a limit shared with other worker processes (a shared-memory core)
    shared = controller.shm_name is not None

    def try_admit() -> Any:
        if controller.tenant_id(tenant.name) != tenant.id:
            # a reload removed the tenant while it waited (its id may even be another
            # tenant's by now): nothing will admit it, and it must not be charged to that one
            raise _NeverFits(REMOVED)
        decision = controller.admit(backend.id, tenant.id, priority, tokens)
        if decision.admitted:
            if gate is not None:
                extra = gate()
                if extra is not None:
                    decision.release(0)
                    last[0] = extra
                    return None
            return decision
        last[0] = decision
        if decision.never:  # limits shrank by a reload: leave the queue, don't block it
            raise _NeverFits(decision)
        if decision.retry_after is not None:
            if decision.reason in _REFILL_REASONS:
                # nothing is released when a bucket refills: look again when it has
                queue.notify_after(decision.retry_after)
            elif shared:
                # with --workers N a slot freed by another worker's request is announced only
                # to that worker's queue: look again after the core's hint (at least MIN_HINT)
                queue.notify_after(max(MIN_HINT, decision.retry_after))
        return None

    try:
        return await queue.wait(
            tenant=tenant.name,
            priority=priority,
            max_wait=allowed_wait(tenant, headers),
            try_admit=try_admit,
            backend=backend.name,
        )
    except _NeverFits as never:
        return never.rejection
    except WaitTimeout:
        if last[0] is not None:
            if in_shadow(gw.config, backend, tenant):  # a reload set shadow mode meanwhile
                gw.metrics.shadow_rejections.labels(last[0].reason).inc()
                return SHADOW_ADMISSION
            return last[0]
        return Refusal("queued", retry_after=queue_hint(gw, backend.id))
    except QueueFull:
        return Refusal("queue-full", retry_after=queue_hint(gw, backend.id))
    except Shed:
        return Refusal("shed")


def _refuse_without_queueing(
    controller: Any, backend: Backend, tenant: Tenant, priority: str, tokens: int
) -> Refusal | None:
    """The refusal a request gets without waiting, judged from the core's base limits (the
    same never-admissible rules the core's ``admit`` applies first), or ``None``."""
    b = controller.backend_state(backend.id)
    t = controller.tenant_state(tenant.id)
    if t["burst_tokens"] is not None and tokens > t["burst_tokens"]:
        return Refusal("tenant-tpm", scope="tenant", retry_after=None, never=True)
    if tokens > b["burst_tokens"]:
        return Refusal("backend-tpm", retry_after=None, never=True)
    if b["inflight_token_limit"] is not None and tokens > b["inflight_token_limit"]:
        return Refusal("inflight-tokens", retry_after=None, never=True)
    if priority == "sheddable" and b["shedding"]:
        return Refusal("shed")
    return None
