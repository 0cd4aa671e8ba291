"""The admission stage of a request: the admission core, then the priority wait queue, then the
store (docs/admission.md).

1. The core decides at once (no await) when nobody is queued: this process's (or host's) view of
   every limit, the never-admissible sizes, shedding.
2. A refusal that waiting can change goes to the priority wait queue
   (:func:`kvgate.admission.waiting.wait_for_admission`); shadow mode
   (:mod:`kvgate.admission.shadow`) only counts it.
3. With a store shared by several replicas (``store:``), what the core admitted must also fit
   in the limits across the replicas: the store's quotas decide locally when they can, Redis
   otherwise (:mod:`kvgate.store`). A store refusal gives the core reservation back; a tenant
   that may wait waits for the store's hint (bounded by its wait time) and asks again.

The result is what the request runs with (released once, by settlement) or the refusal to
answer with. No HTTP here: the request's headers come in as a plain mapping, read only on a
refusal (the client's wait header).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvgate._core import Reservation
from kvgate.admission.refusal import Refusal
from kvgate.admission.shadow import SHADOW_ADMISSION, in_shadow
from kvgate.admission.waiting import allowed_wait, queue_hint, refusal_stands, wait_for_admission
from kvgate.store import StoreRefusal

if TYPE_CHECKING:
    from kvgate.app import Backend, Gateway, Tenant

__all__ = ["Extras", "StoreAdmission", "admit", "holds_slot"]


class StoreAdmission:
    """An admitted request that holds a core reservation and a hold in a shared store.

    :meth:`release` gives both back once (a second call is a no-op).
    """

    __slots__ = ("hold", "reservation", "store", "tokens")
    admitted = True

    def __init__(self, reservation: Any, hold: Any, store: Any, tokens: int) -> None:
        self.reservation = reservation
        self.hold = hold
        self.store = store
        self.tokens = tokens

    def release(self, actual_tokens: int | None = None) -> None:
        """Releases the core reservation and the store hold with ``actual_tokens`` (prompt +
        completion tokens charged; ``None`` = as reserved)."""
        hold = self.hold
        if hold is None:
            return
        self.hold = None
        actual = self.tokens if actual_tokens is None else actual_tokens
        try:
            self.reservation.release(actual_tokens)
        finally:  # the store's hold goes back even if the core refused the count
            self.store.release(hold, self.tokens, actual)


def holds_slot(decision: Any) -> bool:
    """Whether an admitted request holds slots (a shadow admission holds none)."""
    kind = type(decision)
    return kind is Reservation or kind is StoreAdmission


class Extras:
    """What an admitted request holds beyond its reservation: its prompt tokens in the prefill
    budget (until its first bytes) and its place in its class's count for the latency targets.
    :meth:`first_data` and :meth:`finish` are called by the relay and by settlement."""

    __slots__ = ("backend", "first", "priority", "slo", "started", "ticket")

    def __init__(self, backend: str, priority: str, ticket: Any, slo: Any) -> None:
        self.backend = backend
        self.priority = priority
        self.ticket = ticket
        self.slo = slo
        self.started = time.perf_counter()
        self.first: float | None = None
        if slo is not None:
            slo.started(backend, priority)

    def first_data(self) -> None:
        """The engine's first bytes of the answer arrived: the prompt left prefill."""
        if self.first is None:
            self.first = time.perf_counter() - self.started
        if self.ticket is not None:
            self.ticket.leave()

    def finish(self, completion_tokens: int) -> None:
        """The request ended (``completion_tokens`` delivered): its TTFT and time per output
        token are observed for its class."""
        if self.ticket is not None:
            self.ticket.leave()
        if self.slo is not None:
            self.slo.finished(
                self.backend,
                self.priority,
                self.first,
                time.perf_counter() - self.started,
                completion_tokens,
            )
            self.slo = None


async def admit(
    gw: Gateway,
    backend: Backend,
    tenant: Tenant,
    priority: str,
    tokens: int,
    prompt_tokens: int = 0,
    headers: Mapping[str, str] | None = None,
) -> tuple[Any, Extras | None]:
    """Admits a request of ``tokens`` (prompt + reserved completion; ``prompt_tokens`` of them
    its prompt) for ``tenant`` at ``priority`` on ``backend``, through the core, the latency
    targets and the prefill budget, the wait queue and the store. ``headers``: the
    request's headers (read only on a refusal: ``x-kvgate-max-wait-ms`` may shorten the
    tenant's wait), or ``None``.

    Returns:
        What the request runs with (``.admitted`` true, ``.release(actual_tokens)``) and its
        :class:`Extras` (``None`` when no prefill budget or latency target applies), or the
        refusal (``.admitted`` false; ``reason``, ``scope``, ``retry_after``, ``never``) and
        ``None``.
    """
    gate = gw.prefill.get(backend.name) if prompt_tokens else None
    slo = gw.slo
    check = None
    held: list[Any] = [None]
    if gate is not None or slo is not None:

        def check() -> Any:
            if slo is not None and not slo.allow(backend.name, priority):
                return Refusal("slo-limit", retry_after=queue_hint(gw, backend.id))
            if gate is not None:
                ticket = gate.enter(prompt_tokens, priority)
                if ticket is None:
                    return Refusal("prefill-tokens", retry_after=queue_hint(gw, backend.id))
                held[0] = ticket
            return None

    queue = gw.queue
    decision = (
        gw.controller.admit(backend.id, tenant.id, priority, tokens)
        if queue is None or not queue.waiting
        else None
    )
    if check is not None and decision is not None and decision.admitted:
        extra = check()
        if extra is not None:
            decision.release(0)
            decision = extra
    waited_from = None  # when this request started waiting in the queue, if it did
    if decision is None or not decision.admitted:
        if decision is None or not refusal_stands(gw, backend, tenant, decision, headers):
            waited_from = time.monotonic()
            decision = await wait_for_admission(
                gw, backend, tenant, priority, tokens, decision, check, headers
            )
        if not decision.admitted:
            return decision, None
    extras = Extras(backend.name, priority, held[0], slo) if check is not None else None
    store = gw.store
    if store.mode == "local" or type(decision) is not Reservation:
        return decision, extras
    hold = store.try_admit(backend, tenant, priority, tokens)
    if hold is None:
        try:
            spent = 0.0 if waited_from is None else time.monotonic() - waited_from
            hold = await _admit_in_store(gw, backend, tenant, priority, tokens, headers, spent)
        except asyncio.CancelledError:
            # the client went away while the store decided: nothing ran, nothing is charged
            decision.release(0)
            if extras is not None:
                extras.finish(0)
            raise
        if type(hold) is StoreRefusal:
            decision.release(0)
            if extras is not None:
                extras.finish(0)
            if in_shadow(gw.config, backend, tenant):
                gw.metrics.shadow_rejections.labels(hold.reason).inc()
                return SHADOW_ADMISSION, None
            return hold, None
    return StoreAdmission(decision, hold, store, tokens), extras


async def _admit_in_store(
    gw: Gateway,
    backend: Backend,
    tenant: Tenant,
    priority: str,
    tokens: int,
    headers: Mapping[str, str] | None,
    spent: float = 0.0,
) -> Any:
    """The store's decision when this replica's quotas are short; a refusal with a retry hint
    is asked again after the hint while the tenant's wait time lasts (less ``spent``: the
    seconds the request already waited in the queue)."""
    store = gw.store
    result = await store.admit(backend, tenant, priority, tokens)
    if type(result) is not StoreRefusal or result.never:
        return result
    wait = allowed_wait(tenant, headers) - spent
    if wait <= 0:
        return result
    give_up = time.monotonic() + wait
    while type(result) is StoreRefusal and not result.never:
        left = give_up - time.monotonic()
        if left <= 0 or result.reason == "store-unavailable":
            break
        await asyncio.sleep(min(left, max(0.005, result.retry_after or 0.05)))
        result = await store.admit(backend, tenant, priority, tokens)
    return result
