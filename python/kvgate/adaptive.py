"""Adaptive limits: engine metrics → the core's control law → effective limits and shedding.

What: :class:`AdaptiveSink` receives the :class:`~kvgate.telemetry.poller.MetricsPoller`'s
readings for every backend and feeds each one through that backend's
:class:`kvgate.AdaptiveLaw` (high watermark 0.85 → floor 0.6 × base, low watermark
0.70 → back to base, linear in between, decreases at once, recovery at a bounded rate per second,
engine queue deeper than ``waiting_threshold`` counts as pressure). The resulting scale is written
to the admission core (``set_scale``: concurrency and TPM together) and the law's shedding flag
switches the ``sheddable`` class off and on (``set_shedding``). The scale binds the ``sheddable``
class always; ``critical`` and ``standard`` only while the law reads pressure at or above the
high watermark (``set_overload``) and the in-flight budget does not already guard the engine's
memory (:meth:`AdaptiveSink._memory_guarded`): low-priority work gives way first.

The in-flight token budget is not scaled: it already is the engine's KV memory (its capacity ×
``capacity_safety_factor``, or the configured budget), so scaling it by KV pressure as well
would count that pressure twice (with long generations holding their reservations it drove the
budget below the tokens already in flight, and only guaranteed slots got through). Instead each
good reading with a KV usage ratio ``u`` and a known KV capacity ``C`` (tokens, from the
reading itself or the engine's discovery) gives the engine's *external* occupancy, what it
holds beyond kvgate's own in-flight tokens (other clients, fragmentation)::

    external = max(0, round(u × C) − tokens kvgate has in flight on that backend)

written to the core (``set_inflight_external``), which admits against ``max(0, budget −
external)``. kvgate reserves prompt + ``max_tokens`` while the engine holds prompt + the tokens
generated so far, so an engine that serves only kvgate's traffic gives ~0: no throttling.
Without a KV gauge or a known capacity (a configured budget, an engine that states no
capacity) the correction is 0. A reading is a few hundred ms old when applied: requests
released since it was taken still count in ``u`` (external reads high until the next reading,
the safe side); requests admitted since count in-flight but not yet in ``u`` (external reads
low by tokens the engine has not allocated yet).

Inputs: readings (KV-cache usage ratio 0..1, requests waiting, KV capacity in tokens), scrape
failures, staleness and health transitions. An engine that reports no KV gauge (TGI's derived
ratio missing, llama.cpp without ``/slots``) adapts on its queue alone: its KV usage is taken
as 0 for the law.

Config: per backend ``adaptive`` (``enabled``, ``high``, ``low``, ``floor``,
``recovery_per_second``, ``waiting_threshold``, ``poll_interval``, ``stale_after``); the
external-occupancy correction applies to backends with ``enabled``.

Trade-offs: stale metrics (no good scrape for ``stale_after``) drive the backend to the floor
and shed sheddable traffic — never to "unlimited"; the external occupancy keeps its last value
meanwhile. The engine's own KV capacity, when it states it (``vllm:cache_config_info``,
``sglang:max_total_num_tokens``, llama.cpp ``/slots``), becomes the backend's in-flight token
budget × ``capacity_safety_factor`` unless the config sets one.

Visibility: each backend's ``bound_by`` (:class:`kvgate.app.Backend`) names the signal that holds
its concurrency and TPM below base now (see :data:`BOUND_BY`); ``/admin/state`` shows it with
the in-flight budget's (``external-kv`` or ``none``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvgate.app import Gateway
    from kvgate.telemetry.engine_metrics import EngineReading

__all__ = ["BOUND_BY", "AdaptiveSink", "poll_targets"]

#: What can hold a backend's concurrency and TPM below base (``Backend.bound_by``):
#: ``none`` (at base), ``kv-usage`` (the engine's KV usage ratio above the low watermark),
#: ``waiting`` (the engine's queue deeper than ``waiting_threshold``), ``stale`` (no good
#: metrics: the floor), ``recovery`` (pressure gone, climbing back at the bounded rate),
#: ``replicas`` (another replica's more conservative scale, through the shared store).
BOUND_BY = ("none", "kv-usage", "waiting", "stale", "recovery", "replicas")

logger = logging.getLogger("kvgate.adaptive")


class AdaptiveSink:
    """The poller's sink for a gateway: implements :class:`kvgate.telemetry.poller.ReadingSink`.

    Args:
        gateway: the running gateway (its controller, backends and metrics).
        on_shed: called with the backend name when shedding turns on (the wait queue answers
            its queued sheddable requests then).
        law_clock: a ``kvgate.ManualClock`` for the laws (tests); ``None`` = monotonic.

    Attributes:
        laws: backend name → its ``AdaptiveLaw`` (backends with ``adaptive.enabled``).
    """

    __slots__ = ("_capacity", "_gw", "_on_shed", "laws")

    def __init__(
        self,
        gateway: Gateway,
        *,
        on_shed: Callable[[str], None] | None = None,
        law_clock: Any = None,
    ) -> None:
        from kvgate import AdaptiveLaw

        self._gw = gateway
        self._on_shed = on_shed
        self.laws: dict[str, Any] = {}
        # backend name → the engine's KV capacity (tokens) last stated by a reading
        self._capacity: dict[str, int] = {}
        for b in gateway.backends:
            cfg = getattr(b.config, "adaptive", None)
            if cfg is None or not cfg.enabled:
                continue
            self.laws[b.name] = AdaptiveLaw(
                high=cfg.high,
                low=cfg.low,
                floor=cfg.floor,
                recovery_per_second=cfg.recovery_per_second,
                waiting_threshold=cfg.waiting_threshold,
                clock=law_clock,
            )

    def _apply(self, name: str, kv_usage: float | None, waiting: int) -> None:
        law = self.laws.get(name)
        if law is None:
            return
        backend = self._gw.backend_named(name)
        was_shedding = bool(law.shedding)
        before = law.scale
        scale = law.update(kv_usage, waiting)
        ctl = self._gw.controller
        store = self._gw.store
        shed_in_force = bool(law.shedding)
        if store.mode != "local":
            # several replicas: the most conservative live proposal is in force
            scale, shed_in_force = store.propose(name, scale, shed_in_force)
        ctl.set_scale(backend.id, scale)
        backend.bound_by = self._binding(law, scale, kv_usage, waiting)
        # Under the high watermark the scale binds only the sheddable class: critical and
        # standard keep the base limits (low-priority work gives way first). At or above it,
        # they feel it too unless the in-flight budget already guards the engine's memory.
        st = ctl.backend_state(backend.id)
        overloaded = bool(law.overloaded) and not self._memory_guarded(law, st, kv_usage, waiting)
        was_overloaded = bool(st["overloaded"])
        ctl.set_overload(backend.id, overloaded)
        if (scale > before or (was_overloaded and not overloaded)) and self._gw.queue:
            self._gw.queue.notify()  # limits grew: waiters may fit now
        ctl.set_shedding(backend.id, shed_in_force)
        if bool(law.shedding) != was_shedding:
            self._gw.metrics.shedding.labels(name, "sheddable").set(1 if law.shedding else 0)
            logger.warning(
                "backend %s: %s sheddable traffic (kv_usage=%s, waiting=%d)",
                name,
                "shedding" if law.shedding else "no longer shedding",
                kv_usage,
                waiting,
            )
            if law.shedding and self._on_shed is not None:
                self._on_shed(name)

    def _memory_guarded(
        self, law: Any, st: dict[str, Any], kv_usage: float | None, waiting: int
    ) -> bool:
        """Whether a KV reading at or above the high watermark is already answered by the
        in-flight token budget, so that the scale need not bind the critical and standard
        classes (the sheddable class is shed either way).

        True when the backend has an in-flight budget and the engine states its KV capacity
        (tokens: vLLM's ``num_gpu_blocks × block_size``, SGLang's ``max_total_num_tokens``,
        ...): every request is then admitted against that budget less the engine's external
        KV occupancy, which counts exactly the memory the watermark only approximates. False
        with a missing reading (stale metrics), when the engine's waiting requests exceed
        ``waiting_threshold`` (a queue, not memory: only a smaller concurrency helps), or
        without a stated capacity (the watermark is then the only memory guard).
        """
        if kv_usage is None or waiting > law.waiting_threshold:
            return False
        if st["inflight_token_limit"] is None:
            return False
        name = st["name"]
        cap = self._capacity.get(name)
        if cap is None:
            cap = getattr(self._gw.discovery.get(name), "kv_capacity_tokens", None)
        return bool(cap)

    @staticmethod
    def _binding(law: Any, scale: float, kv_usage: float | None, waiting: int) -> str:
        """Which signal holds the scale below 1 (:data:`BOUND_BY`)."""
        if kv_usage is None:
            return "stale"
        if scale >= 1.0:
            return "none"
        if scale < law.scale - 1e-9:
            return "replicas"
        queued = waiting > law.waiting_threshold
        if queued and kv_usage < law.high:
            return "waiting"
        if kv_usage > law.low:
            return "kv-usage"
        return "waiting" if queued else "recovery"

    def _correct_inflight(self, b: Any, reading: EngineReading) -> None:
        """Sets the backend's external KV occupancy from a good reading: ``max(0, round(u ×
        C) − in-flight tokens)`` with ``u`` the KV usage ratio and ``C`` the engine's KV
        capacity (tokens); 0 when either is unknown. With several replicas on a store, the
        in-flight tokens are every replica's (the budget allocated to all of them in Redis).
        Only for adaptive backends."""
        if b.name not in self.laws:
            return
        if reading.kv_capacity_tokens:
            self._capacity[b.name] = reading.kv_capacity_tokens
        cap = self._capacity.get(b.name)
        if cap is None:
            found = self._gw.discovery.get(b.name)
            cap = getattr(found, "kv_capacity_tokens", None)
        ctl = self._gw.controller
        st = ctl.backend_state(b.id)
        external = 0
        if reading.kv_usage is not None and cap:
            inflight = int(st["inflight_tokens"])
            # several replicas: the engine also holds the others' requests
            everyone = self._gw.store.inflight_allocated(b.name)
            if everyone is not None:
                inflight = max(inflight, everyone)
            external = max(0, round(reading.kv_usage * cap) - inflight)
        old = int(st["inflight_external_tokens"])
        if external == old:
            return
        ctl.set_inflight_external(b.id, external)
        if external < old and self._gw.queue:
            self._gw.queue.notify()  # the budget grew: waiters may fit now

    def on_reading(self, backend: str, reading: EngineReading, now: float) -> None:
        """A good reading: record it, feed the law, discover capacity, set the engine's
        external KV occupancy (:meth:`_correct_inflight`)."""
        b = self._gw.backend_named(backend)
        b.kv_usage, b.waiting = reading.kv_usage, reading.waiting
        m = self._gw.metrics
        if reading.kv_usage is not None:
            m.backend_kv_usage.labels(backend).set(reading.kv_usage)
        if reading.waiting is not None:
            m.backend_waiting.labels(backend).set(reading.waiting)
        # no KV gauge on this engine: adapt on the queue alone
        kv = reading.kv_usage if reading.kv_usage is not None else 0.0
        self._apply(backend, kv, int(reading.waiting or 0))
        self._discover_capacity(b, reading)
        self._discover_slots(b, reading)
        self._correct_inflight(b, reading)

    def _discover_slots(self, b: Any, reading: EngineReading) -> None:
        """A slot limit left to the engine (the quick start's, or a backend without
        ``max_concurrency``) follows the engine's own (llama.cpp ``/slots``), e.g. after the
        engine restarted with another ``--parallel``, never below the guaranteed slots of the
        tenants that use the backend (queued requests that now fit are admitted at once); a
        configured limit never changes here."""
        slots = reading.slots
        known = self._gw.engine_slots.get(b.name)
        if not slots or known is None or slots == known:
            return
        self._gw.engine_slots[b.name] = slots
        ctl = self._gw.controller
        limit = max(slots, int(ctl.backend_state(b.id)["guaranteed_slots"]))
        ctl.update_backend(b.id, max_concurrency=limit)
        self._gw.store.reload()
        self._gw.notify_waiters()  # a higher limit: waiters may fit now
        logger.info(
            "backend %s: slot limit %d (the engine's %d slots, was %d)", b.name, limit, slots, known
        )

    def _discover_capacity(self, b: Any, reading: EngineReading) -> None:
        cap = reading.kv_capacity_tokens
        if not cap or b.config is None or b.config.inflight_token_limit is not None:
            return
        budget = max(1, int(cap * b.config.capacity_safety_factor))
        if self._gw.discovered_capacity.get(b.name) == budget:
            return
        self._gw.discovered_capacity[b.name] = budget
        self._gw.set_prefill_capacity(b.name, cap)
        self._gw.controller.update_backend(b.id, inflight_token_limit=budget)
        self._gw.store.reload()
        self._gw.notify_waiters()  # a larger budget: waiters may fit now
        logger.info(
            "backend %s: in-flight token budget %d (engine KV capacity %d × %.2f)",
            b.name,
            budget,
            cap,
            b.config.capacity_safety_factor,
        )

    def on_failure(self, backend: str, reason: str, message: str, now: float) -> None:
        """A failed scrape: counted (the poller logs transitions, not every failure)."""
        self._gw.metrics.scrape_errors.labels(backend).inc()

    def on_stale(self, backend: str, stale: bool, now: float) -> None:
        """Stale metrics: go to the floor and shed; fresh again: the readings decide, and the
        limits recover from the floor at the bounded rate from now (the outage is not
        recovery time)."""
        b = self._gw.backend_named(backend)
        b.stale = stale
        self._gw.metrics.metrics_stale.labels(backend).set(1 if stale else 0)
        if backend not in self.laws:
            return
        if stale:
            logger.warning(
                "backend %s: limits go to the floor scale until its metrics come back", backend
            )
        # stale: the floor; fresh again (called just before the first good reading): the floor
        # once more, which restarts the law's recovery clock now
        self._apply(backend, None, 0)

    def on_health(self, backend: str, healthy: bool, now: float) -> None:
        """Take a backend out of routing (or put it back)."""
        self._gw.backend_named(backend).healthy = healthy
        logger.warning("backend %s is %s", backend, "healthy again" if healthy else "unhealthy")


def poll_targets(gateway: Gateway) -> list[Any]:
    """One :class:`~kvgate.telemetry.poller.PollTarget` per backend of ``gateway``."""
    from kvgate.telemetry.poller import PollTarget

    targets = []
    for b in gateway.backends:
        cfg = b.config
        found = gateway.discovery.get(b.name)
        adaptive = getattr(cfg, "adaptive", None)
        interval = adaptive.poll_interval if adaptive is not None else 1.0
        targets.append(
            PollTarget(
                name=b.name,
                metrics_url=b.metrics_url,
                engine=b.engine,
                model=b.models[0] if len(b.models) == 1 else None,
                health_url=cfg.effective_health_url if cfg is not None else None,
                # with `auto`, read only once the metrics name llama.cpp
                slots_url=(b.url + "/slots") if b.engine in ("llamacpp", "auto") else None,
                kv_unified=bool(found is not None and found.kv_unified),
                poll_interval=interval,
                scrape_timeout=getattr(adaptive, "scrape_timeout", None),
                stale_after=adaptive.stale_after if adaptive is not None else 5.0,
                adaptive=adaptive is not None and adaptive.enabled,
                headers=(
                    {"Authorization": f"Bearer {b.api_key}"} if b.api_key is not None else None
                ),
            )
        )
    return targets
